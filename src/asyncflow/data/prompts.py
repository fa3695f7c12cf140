"""Training prompts: the seed-determined order of a run's examples, and their tokenized form.

Owns: `TrainSet` (examples in a resumable, seed-determined order), `open_task` and `open_datasets` (a task or
files -> a `TrainSet` and the held-out list), `Prompt` (one tokenized prompt of a run) and
`PromptEncoder` (example -> `Prompt`, with the long-prompt policy) and `PromptSource` (the run's next
prompts and the data cursor that names where they come from).

Invariants: the order of training prompts is a pure function of (seed, position), so a run
resumed at data position P sees exactly the prompts the uninterrupted run would have seen; restoring a
`PromptSource.cursor()` makes `next_prompts` repeat itself exactly. The cursor carries the training
data's fingerprint (count and sha256 of the examples), so a resume can tell that the data changed
(`data_change`) before it trains a prompt twice or skips one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncflow.data.files import load_examples
from asyncflow.data.records import Example
from asyncflow.data.tasks import Task, make_task


@dataclass
class TrainSet:
    examples: list[Example]
    seed: int
    _epoch: int | None = field(default=None, init=False, repr=False, compare=False)
    _order: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _fingerprint: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.examples:
            raise ValueError("the training set is empty")

    def fingerprint(self) -> dict[str, Any]:
        """{"examples": count, "sha256": of every (prompt, answer) in file order}: what fixes the prompt order."""
        if self._fingerprint is None:
            digest = hashlib.sha256()
            for example in self.examples:
                digest.update(f"{len(example.prompt)}:{example.prompt}{len(example.answer)}:{example.answer}".encode())
            self._fingerprint = {"examples": len(self.examples), "sha256": digest.hexdigest()}
        return dict(self._fingerprint)

    def at(self, position: int) -> Example:
        """The example served at global position `position` (epochs reshuffled by seed)."""
        epoch, offset = divmod(position, len(self.examples))
        if self._order is None or self._epoch != epoch:  # the order of one epoch is computed once, not per example
            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))
            self._epoch = epoch
        return self.examples[int(self._order[offset])]


def open_task(data: Any, seed: int) -> Task:
    """The task `data.task` names (`data` is a `DataConfig`; asyncflow.config is a layer above, hence Any), with
    its difficulty or its options."""
    return make_task(data.task, difficulty=data.difficulty, seed=seed, options=data.task_options,
                     partial_credit=data.partial_credit)


def open_datasets(data: Any, seed: int) -> tuple[TrainSet, list[Example]]:
    """The training set and the held-out examples of `data` (a `DataConfig`: a task or files)."""
    task = open_task(data, seed) if data.task else None
    if data.path:
        train = load_examples(data.path, prompt_field=data.prompt_field, answer_field=data.answer_field)
    elif task is not None:
        train = task.examples("train", data.train_size or task.train_pool_size)
    else:  # the config rejects this too
        raise ValueError("data.task is null and data.path is not set: give a built-in task or a data file")
    if data.test_path:
        test = load_examples(data.test_path, prompt_field=data.prompt_field, answer_field=data.answer_field)
    elif task is not None:
        test = task.examples("test", data.test_size)
    else:
        test = []
    return TrainSet(train, seed), test[: data.test_size]


@dataclass
class Prompt:
    """One prompt of the dataset, tokenized. `group_id` is unique within a run."""

    group_id: int
    prompt_ids: list[int]
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


class PromptEncoder:
    """Tokenizes examples into `Prompt`s with `render` (text -> token ids, chat template included), applying
    the long-prompt policy: `on_long="skip"` skips and counts a prompt over `max_tokens`, `"error"` stops.
    `keep_text` puts the prompt's text in its metadata (`"prompt"`: an agent starts from the text, not the ids;
    a judge reward quotes it)."""

    def __init__(self, render: Callable[[str], list[int]], max_tokens: int, on_long: str, *, keep_text: bool = False):
        self.render = render
        self.max_tokens = max_tokens
        self.on_long = on_long
        self.keep_text = keep_text
        self.skipped = 0
        self._rendered: dict[str, list[int]] = {}  # text -> ids: evaluation and later epochs see a prompt again

    def encode(self, example: Example, group_id: int) -> Prompt | None:
        if example.prompt not in self._rendered:
            self._rendered[example.prompt] = self.render(example.prompt)
        ids = list(self._rendered[example.prompt])
        if len(ids) > self.max_tokens:
            if self.on_long == "error":
                raise ValueError(
                    f"prompt of {example.source or 'example'} has {len(ids)} tokens > data.max_prompt_tokens="
                    f"{self.max_tokens} (set data.on_long_prompt=skip to skip such prompts)"
                )
            self.skipped += 1
            return None
        metadata = {**example.metadata, "prompt": example.prompt} if self.keep_text else dict(example.metadata)
        return Prompt(group_id, ids, example.answer, metadata)


class PromptSource:
    """The run's training prompts in seed order: `next_prompts(n)` encodes the next `n` (skipping and counting
    long ones), giving each a new group id."""

    def __init__(self, train_set: TrainSet, encoder: PromptEncoder):
        self.train_set = train_set
        self.encoder = encoder
        self.position = 0
        self.next_group_id = 0

    def cursor(self) -> dict[str, Any]:
        """Where the next prompt comes from (checkpointed)."""
        return {"data_position": self.position, "next_group_id": self.next_group_id,
                "skipped_long_prompts": self.encoder.skipped, "data_fingerprint": self.train_set.fingerprint()}

    def restore(self, cursor: dict[str, Any]) -> None:
        self.position = cursor["data_position"]
        self.next_group_id = cursor["next_group_id"]
        self.encoder.skipped = cursor.get("skipped_long_prompts", 0)

    def next_prompts(self, n: int) -> list[Prompt]:
        prompts: list[Prompt] = []
        skipped_in_a_row = 0
        while len(prompts) < n:
            example = self.train_set.at(self.position)
            self.position += 1
            prompt = self.encoder.encode(example, self.next_group_id)
            if prompt is None:
                skipped_in_a_row += 1
                if skipped_in_a_row >= len(self.train_set.examples):
                    raise ValueError(
                        f"every training prompt is longer than data.max_prompt_tokens={self.encoder.max_tokens} "
                        "tokens: nothing left to train on (raise data.max_prompt_tokens)"
                    )
                continue
            prompts.append(prompt)
            self.next_group_id += 1
            skipped_in_a_row = 0
        return prompts


def data_change(recorded: dict[str, Any] | None, train_set: TrainSet) -> str | None:
    """How `train_set` differs from the training data a checkpoint `recorded` (its `data_fingerprint`), or None
    when it is the same (or the checkpoint predates fingerprints)."""
    if not recorded:
        return None
    now = train_set.fingerprint()
    if now == recorded:
        return None
    if now["examples"] != recorded["examples"]:
        return f"{recorded['examples']} training examples then, {now['examples']} now"
    return f"the same number of training examples ({now['examples']}), different content"
