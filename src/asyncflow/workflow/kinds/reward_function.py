"""The function reward kind: a `reward.fns` entry that names a reward function (registered, `exact_match`, or
`package.module:function`), scored by the reward runner as written.

Owns: what `asyncflow.workflow.kinds.RewardKind` asks, for string entries.
"""

from __future__ import annotations

from asyncflow.config import Config


class FunctionReward:
    reads_prompt = False

    def spec(self, entry: str, config: Config) -> str:
        return entry  # resolved and checked by the runner (`asyncflow.rewards.check_reward_specs`)
