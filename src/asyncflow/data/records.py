"""The record every dataset loader and built-in task produces: `Example`.

Owns: `Example` and `DatasetError`.
Invariants:
- `prompt` and `answer` are strings (loaders convert numeric answers with str()); `answer` is the
  ground truth handed to a reward verifier, never shown to the policy.
- `source` says where the example came from ("train.jsonl:12", "data.parquet[3]",
  "arithmetic-d2-s0/test[5]") so that an error about an example can point at its origin.
- `metadata` is read, never changed in place (examples may share one dict): copy it to add fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class DatasetError(ValueError):
    """A dataset file or row cannot be turned into examples; the message names file, line/row and field."""


@dataclass
class Example:
    prompt: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("prompt", "answer", "source"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"Example.{name} must be a str, got {type(value).__name__}: {value!r}")
        if not isinstance(self.metadata, dict):
            raise TypeError(f"Example.metadata must be a dict, got {type(self.metadata).__name__}")
