"""The built-in environment kind: prompts of a built-in task or a data file (`data`), single-turn, or multi-turn
episodes in one of asyncflow's environments (`env.name`: a registered name or `module:factory`), or an agent's
(`agent.fn`).

Owns: what `asyncflow.workflow.kinds.EnvironmentKind` asks, for any `env.name` no other kind claims (none too),
and `check_python_isolation`.

Invariants: the checks write nothing and load no model; the prompts are rendered as the rollout renders them
(the chat template when `model.use_chat_template`). With `agent.fn` and `env.name` both set (the environment's
demonstrations warm the agent up, its episodes are the held-out evaluation) a prompt is rendered as the run's server
renders the agent's first call: a user message with the agent's `tools` (`fn.tools`) through its chat template
(`agent_render`), so SFT, evaluation and the agent's calls see the same ids.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncflow.config import Config
from asyncflow.data import Example
from asyncflow.data.prompts import TrainSet, open_datasets, open_task
from asyncflow.envs.base import resolve_environment
from asyncflow.models.loading import prompt_lengths, render_chat, render_prompt
from asyncflow.rewards.contract import RewardFn


class BuiltinEnvironment:
    def __init__(self, config: Config):
        self.config = config

    def check(self) -> None:
        if self.config.env.name is not None:
            resolve_environment(self.config.env.name)  # raises EnvironmentSpecError naming env.name
            check_python_isolation(self.config)

    def check_tokenizer(self, tokenizer) -> None:
        pass

    def datasets(self) -> tuple[TrainSet, list[Example]]:
        return open_datasets(self.config.data, self.config.run.seed)

    def render(self, tokenizer) -> Callable[[str], list[int]]:
        agent = agent_render(self.config, tokenizer)
        if agent is not None:
            return agent
        use_chat = self.config.model.use_chat_template
        return lambda text: render_prompt(tokenizer, text, use_chat)

    def prompt_lengths(self, tokenizer, prompts: list[str]) -> list[int]:
        agent = agent_render(self.config, tokenizer)
        if agent is not None:
            return [len(agent(prompt)) for prompt in prompts]
        return prompt_lengths(tokenizer, prompts, self.config.model.use_chat_template)  # every prompt, in bulk

    def auto_rewards(self) -> list[str | RewardFn]:
        if not self.config.data.task:
            raise ValueError("reward.fns is 'auto' but there is no built-in task: name reward functions in reward.fns")
        return [open_task(self.config.data, self.config.run.seed).verifier]

    def multiturn_env(self) -> str | None:
        return self.config.env.name

    def agent(self) -> Any:
        from asyncflow.workers.agent import absolute_agent_spec

        return None if self.config.agent.fn is None else absolute_agent_spec(self.config.agent.fn)


def agent_render(config: Config, tokenizer) -> Callable[[str], list[int]] | None:
    """With `agent.fn` and `env.name` set: prompt text -> the ids the run's server gives the agent's first chat call
    (one user message and the agent's `tools` attribute, rendered by `agent.chat_template` or the tokenizer's
    template, then tokenized as the server tokenizes); None otherwise, or without a chat template."""
    from asyncflow.workers.agent import resolve_agent

    a = config.agent
    if a.fn is None or config.env.name is None:
        return None
    template = Path(a.chat_template).read_text() if a.chat_template else getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    tools = getattr(resolve_agent(a.fn), "tools", None)
    return lambda text: render_chat(tokenizer, [{"role": "user", "content": text}], template, tools)


def check_python_isolation(config: Config) -> None:
    """`env.python_isolation=strict` with the `python` tool in reach: bubblewrap must run here, else a one-line
    error naming what is missing and the key that accepts weaker isolation."""
    from asyncflow.envs.sandbox import SandboxLimits, SandboxUnavailable, check_isolation

    if config.env.name == "calculator" or config.env.python_isolation != "strict":
        return
    try:
        check_isolation(SandboxLimits(isolation="strict"))
    except SandboxUnavailable as err:
        raise ValueError(str(err)) from None
