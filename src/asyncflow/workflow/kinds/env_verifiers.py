"""The `verifiers:` environment kind (`env.name: verifiers:MODULE_OR_ID`): the environment's dataset is the data,
its prompts are chat messages, and each episode is one of its rollouts, run as an agent through the run's server
and scored by its rubric (`asyncflow.envs.verifiers_env`).

Owns: what `asyncflow.workflow.kinds.EnvironmentKind` asks, for `env.name` starting `verifiers:`, and
`check_chat_template`.

Invariants: a prompt is rendered as the server renders an episode's first call (`agent.chat_template` or the
tokenizer's); the environment has no held-out examples (its episodes are not evaluated by `eval.every`) and no
multi-turn rollout of asyncflow's (its episodes are agent episodes).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from asyncflow.config import Config
from asyncflow.data import Example
from asyncflow.data.prompts import TrainSet
from asyncflow.envs.verifiers_env import (
    VerifiersAgent,
    absolute_env_name,
    load_verifiers_env,
    render_messages,
    verifiers_examples,
)
from asyncflow.rewards.contract import RewardFn


class VerifiersEnvironment:
    def __init__(self, config: Config):
        assert config.env.name is not None, "the verifiers kind is chosen by env.name"
        self.config = config
        self.name = config.env.name

    def check(self) -> None:
        load_verifiers_env(self.name, self.config.env.options)  # raises EnvironmentSpecError naming env.name

    def check_tokenizer(self, tokenizer) -> None:
        check_chat_template(self.config, tokenizer)

    def datasets(self) -> tuple[TrainSet, list[Example]]:
        """Its dataset's rows (`data.train_size` of them at most) for training; no held-out examples."""
        rows = verifiers_examples(self.name, self.config.env.options, self.config.data.train_size)
        return TrainSet([Example(*row) for row in rows], self.config.run.seed), []

    def render(self, tokenizer) -> Callable[[str], list[int]]:
        chat_template = self.config.agent.chat_template
        template = Path(chat_template).read_text() if chat_template else None
        return lambda text: render_messages(tokenizer, text, template)

    def prompt_lengths(self, tokenizer, prompts: list[str]) -> list[int]:
        render = self.render(tokenizer)  # messages as JSON, rendered as the server renders them
        return [len(render(prompt)) for prompt in prompts]

    def auto_rewards(self) -> list[str | RewardFn]:
        return ["asyncflow.envs.verifiers_env:rubric_only"]  # the environment's rubric scores its episodes

    def multiturn_env(self) -> str | None:
        return None  # its episodes are agent episodes

    def agent(self) -> VerifiersAgent:
        r = self.config.rollout
        sampling = {"temperature": r.temperature, "top_p": r.top_p, "max_tokens": r.max_new_tokens}
        return VerifiersAgent(absolute_env_name(self.name), self.config.env.options, sampling,
                              self.config.agent.episode_timeout_s)


def check_chat_template(config: Config, tokenizer) -> None:
    """A `verifiers:` environment talks to the model in chat messages: the model needs a chat template (its
    tokenizer's, or `agent.chat_template`), and every training prompt must render with it."""
    if not (config.agent.chat_template or getattr(tokenizer, "chat_template", None)):
        raise ValueError(f"env.name={config.env.name} sends chat messages, and the model's tokenizer has no chat "
                         "template: give one with agent.chat_template=FILE (a Jinja template)")
