"""reasoning-gym's procedural datasets as asyncflow tasks: `data.task: reasoning_gym:NAME`.

Owns: `ReasoningGymTask` (a `Task` whose examples are items of the library's dataset NAME, built with the
library's own config keys, `data.task_options`), `ReasoningGymScore` (the library's `score_answer` of that
dataset as a reward function) and `PREFIX`.

Invariants:
- An example is the library's item at an index drawn from the task's seeded split stream (train, validation
  and test streams have distinct fixed seeds, `Task`), so splits are deterministic per (NAME, options, run
  seed) and, through the fixed prompt partition of `tasks.py`, never share a prompt. The prompt is the item's
  question as the library writes it, the answer its answer; the row's metadata carries the item's index.
- The reward is the library's verdict: `ReasoningGymScore` rebuilds the item from its index (the library's
  items are a pure function of config, seed and index, so nothing but an int travels with the row) and calls
  the dataset's `score_answer` on the completion's last `<answer>...</answer>`, or on the whole completion
  stripped when it has no such tag. A row whose answer is not the rebuilt item's raises ValueError. With
  `partial_credit=False` a score below 1 (the library's partial credit, e.g. 2/3 for "155" against "55") is 0.
- `reasoning_gym` is imported on first use; missing, it is a one-line `DatasetError` naming the extra.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import re
from typing import Any

from asyncflow.data.records import DatasetError
from asyncflow.data.tasks import Task

PREFIX = "reasoning_gym:"
RESERVED_OPTIONS = ("seed", "size")  # the task draws its own indices; the library's dataset is unbounded
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_INDEX_RANGE = 2**31  # item indices are drawn from [0, _INDEX_RANGE)


@functools.lru_cache(maxsize=16)
def _dataset(name: str, options_json: str) -> Any:
    """The library's dataset NAME with `options` (its config keys), its seed fixed at 0 (indices vary)."""
    try:
        import reasoning_gym
    except ImportError:
        raise DatasetError(
            f"data.task {PREFIX}{name} needs reasoning-gym: pip install 'asyncflow-rl[reasoning-gym]'") from None
    options = json.loads(options_json)
    try:
        return reasoning_gym.create_dataset(name, seed=0, size=_INDEX_RANGE, **options)
    except ValueError as err:  # an unknown name
        raise DatasetError(f"data.task {PREFIX}{name}: {err}") from None
    except (TypeError, AssertionError) as err:  # an unknown or invalid config key
        raise DatasetError(f"data.task_options for {PREFIX}{name} are not that dataset's config: {err}") from None


def _options_json(name: str, options: dict[str, Any] | None) -> str:
    options = dict(options or {})
    reserved = sorted(set(options) & set(RESERVED_OPTIONS))
    if reserved:
        raise DatasetError(f"data.task_options for {PREFIX}{name}: {reserved} are set by asyncflow (run.seed splits)")
    return json.dumps(options, sort_keys=True)


class ReasoningGymScore:
    """The reward of `reasoning_gym:NAME`: `fn(completion, ground_truth, **metadata)` with the row's
    `reasoning_gym_index`; picklable (the dataset is rebuilt in each process)."""

    def __init__(self, name: str, options: dict[str, Any] | None = None, partial_credit: bool = True) -> None:
        self.name = name
        self.options_json = _options_json(name, options)
        self.reward_name = f"{PREFIX}{name}"
        self.partial_credit = partial_credit

    def dataset(self) -> Any:
        """The library's dataset object (reasoning_gym ships no types)."""
        return _dataset(self.name, self.options_json)

    def __call__(self, completion: str, ground_truth: str, **metadata: Any) -> float:
        dataset = self.dataset()
        entry = dataset[metadata["reasoning_gym_index"]]
        if str(entry["answer"]) != ground_truth:
            raise ValueError(f"{self.reward_name}: the row's answer {ground_truth!r} is not its item's "
                             f"{entry['answer']!r} (data.task_options changed since the data was made?)")
        tagged = _ANSWER_TAG.findall(completion)
        answer = (tagged[-1] if tagged else completion).strip()
        score = float(dataset.score_answer(answer, entry))
        return score if self.partial_credit or score >= 1.0 else 0.0


class ReasoningGymTask(Task):
    """Dataset NAME of reasoning-gym with the library's config keys `options`; see the module invariants.
    Difficulty is the library's: set it through `options` (e.g. `{min_terms: 2, max_terms: 3}`)."""

    verifier: ReasoningGymScore
    default_difficulty = 1
    levels = {1: None}  # one level: the library's own config sets the difficulty
    train_pool_size = 5_000  # some of the library's generators take milliseconds an item

    def __init__(
        self, name: str, options: dict[str, Any] | None = None, seed: int = 0, partial_credit: bool = True
    ) -> None:
        self.name = f"{PREFIX}{name}"
        self.verifier = ReasoningGymScore(name, options, partial_credit)
        self.verifier.dataset()  # an unknown name or option fails here, not at the first sample
        super().__init__(seed=seed)
        digest = hashlib.blake2b(self.verifier.options_json.encode(), digest_size=4).hexdigest()
        self.label = f"{self.name}-{digest}-s{seed}"  # the split streams' seeds: distinct per options and seed

    def sample(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        index = rng.randrange(_INDEX_RANGE)
        item = self.verifier.dataset()[index]
        return item["question"], str(item["answer"]), {"reasoning_gym_index": index}
