"""The kinds of environment and of reward a config can name, and the two registries that pick one.

Owns: `EnvironmentKind` and `RewardKind` (what a run's set-up asks of a kind), `ENVIRONMENT_KINDS` (an
`env.name` prefix -> its kind's class; any other `env.name`, or none, is `BuiltinEnvironment`: a built-in task or
data file, with asyncflow's own environments), `REWARD_KINDS` (the `kind` of a `reward.fns` entry -> its kind; a
name or spec string is `function`), and the look-ups `environment_kind(config)` / `reward_kind(entry)`.

An environment kind is built from the config (`environment_kind(config)`) and answers for that config; a kind reads
the config and hands its integration code (in `asyncflow.envs`, `asyncflow.rewards`) plain values, as
`asyncflow.workflow.setup` does; `setup` asks the config's kinds and never which kind they are. A new kind is one
module in this package and one line in its registry (a reward kind also adds its entry's section to `reward.fns`
in config.py); see docs/bring-your-own.md.

Invariants: a kind writes nothing and loads no model (a tokenizer at most, handed to it); every answer is a
function of the config (and a tokenizer), so a Ray actor rebuilds the same pieces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from asyncflow.config import Config
from asyncflow.data import Example
from asyncflow.data.prompts import TrainSet
from asyncflow.envs.verifiers_env import PREFIX as VERIFIERS_PREFIX
from asyncflow.rewards.contract import RewardFn
from asyncflow.workflow.kinds.env_builtin import BuiltinEnvironment
from asyncflow.workflow.kinds.env_verifiers import VerifiersEnvironment
from asyncflow.workflow.kinds.reward_function import FunctionReward
from asyncflow.workflow.kinds.reward_judge import JudgeRewardKind


class EnvironmentKind(Protocol):
    """Where the prompts of a run (the config it was built from) come from, how the policy sees them, and who runs
    their episodes."""

    def check(self) -> None:
        """`preflight`, before the data is read: the environment resolves (else an error naming `env.name`)."""

    def check_tokenizer(self, tokenizer) -> None:
        """`preflight`, once the policy's tokenizer is loaded: the prompts can be rendered with it."""

    def datasets(self) -> tuple[TrainSet, list[Example]]:
        """The training set (seed-ordered) and the held-out examples."""

    def render(self, tokenizer) -> Callable[[str], list[int]]:
        """A prompt's text -> the ids the policy is given."""

    def prompt_lengths(self, tokenizer, prompts: list[str]) -> list[int]:
        """Each prompt's length in tokens once rendered as `render` renders it (`data.on_long_prompt=error`)."""

    def auto_rewards(self) -> list[str | RewardFn]:
        """What `reward.fns: [auto]` scores with."""

    def multiturn_env(self) -> str | None:
        """The environment (`asyncflow.envs` spec) whose episodes the multi-turn rollout runs with the `env`
        section's settings; None: single-turn rollouts, or episodes run by the kind's `agent`."""

    def agent(self) -> Any:
        """The agent (`asyncflow.workers.agent`) of a run whose rollouts are agent episodes (`config.agent_rollouts`;
        asked only then)."""


class RewardKind(Protocol):
    """One kind of `reward.fns` entry."""

    reads_prompt: bool
    """Its calls read the prompt's text: the rows keep it in their metadata."""

    def spec(self, entry: Any, config: Config) -> str | RewardFn:
        """`entry` as the reward runner takes it: a registered name, `module:function`, or a callable."""


#: `env.name` prefix -> the class (called with the config) of the kind that claims it.
ENVIRONMENT_KINDS: dict[str, Callable[[Config], EnvironmentKind]] = {
    VERIFIERS_PREFIX: VerifiersEnvironment,
}
REWARD_KINDS: dict[str, RewardKind] = {
    "function": FunctionReward(),
    "judge": JudgeRewardKind(),
}


def environment_kind(config: Config) -> EnvironmentKind:
    """The kind of `config.env.name` (the one whose prefix it starts with, else `BuiltinEnvironment`), built from
    `config`."""
    name = config.env.name or ""
    kind = next((kind for prefix, kind in ENVIRONMENT_KINDS.items() if name.startswith(prefix)), BuiltinEnvironment)
    return kind(config)


def reward_kind(entry: Any) -> RewardKind:
    """The kind of a `reward.fns` entry: its section's `kind` (`judge`), `function` for a name or spec string."""
    return REWARD_KINDS["function" if isinstance(entry, str) else entry.kind]
