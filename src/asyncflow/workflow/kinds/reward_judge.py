"""The judge reward kind: a `reward.fns` entry with `kind: judge` (`JudgeRewardConfig`), a model behind an
OpenAI-compatible endpoint scoring each completion (`asyncflow.rewards.judge`).

Owns: what `asyncflow.workflow.kinds.RewardKind` asks, for judge entries, and `JUDGE_SHARE`.

Invariant: a judge call ends within `reward.timeout_s`.
"""

from __future__ import annotations

from asyncflow.config import Config, JudgeRewardConfig
from asyncflow.rewards.judge import JudgeReward

#: A judge call gives up at this share of `reward.timeout_s`, so the runner counts a slow judge as an error
#: instead of abandoning a thread stuck in it.
JUDGE_SHARE = 0.9


class JudgeRewardKind:
    reads_prompt = True  # the judge is shown the prompt

    def spec(self, entry: JudgeRewardConfig, config: Config) -> JudgeReward:
        return JudgeReward(**entry.judge_options(), budget_s=JUDGE_SHARE * config.reward.timeout_s)
