"""Load prompt/answer datasets from disk: JSONL, Parquet, or a saved Hugging Face dataset folder.

Owns: `load_examples`.
Invariants:
- Every row becomes exactly one `Example`, in file order; nothing is skipped silently except
  blank JSONL lines.
- A row that cannot be used raises `DatasetError` naming the file, the position (1-based line for
  JSONL, 0-based row index for Parquet and HF datasets), the problem (missing/null field, bad
  JSON, non-object row) and the fields the row does have.
- Answers: strings are kept as is, numbers go through str(), lists/dicts through json.dumps (so a
  structured ground truth stays machine-readable); a null answer is an error. Prompts must be
  strings. Every other field goes to `metadata` unchanged.
- `split` selects a split of an HF `DatasetDict`; it is an error for single files and for a
  folder holding one plain `Dataset`, rather than being ignored.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asyncflow.data.records import DatasetError, Example


def load_examples(
    path: str | Path,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    split: str | None = None,
) -> list[Example]:
    """Examples from a `.jsonl` file, a `.parquet` file, or a folder written by `Dataset.save_to_disk`."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"{path}: no such file or folder")
    if path.is_dir():
        rows = _hf_rows(path, split)
    else:
        if split is not None:
            raise DatasetError(f"{path}: split={split!r} only applies to a saved HF dataset folder, not a file")
        if path.suffix == ".jsonl":
            rows = _jsonl_rows(path)
        elif path.suffix == ".parquet":
            rows = _parquet_rows(path)
        else:
            raise DatasetError(
                f"{path}: unsupported dataset format {path.suffix!r}; use .jsonl, .parquet or a saved HF dataset folder"
            )
    return [_to_example(row, where, prompt_field, answer_field) for row, where in rows]


def _jsonl_rows(path: Path) -> Iterator[tuple[dict[str, Any], str]]:
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                message = f"{where}: line {line_number} is not valid JSON ({err.msg} at column {err.colno})"
                raise DatasetError(message) from None
            if not isinstance(row, dict):
                raise DatasetError(f"{where}: line {line_number} is a JSON {type(row).__name__}, expected an object")
            yield row, where


def _parquet_rows(path: Path) -> Iterator[tuple[dict[str, Any], str]]:
    import pyarrow.parquet as pq

    try:
        parquet_file = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises ArrowInvalid/OSError variants for unreadable files
        raise DatasetError(f"{path}: cannot read as Parquet ({err})") from None
    index = 0
    for batch in parquet_file.iter_batches():
        for row in batch.to_pylist():
            yield row, f"{path}[{index}]"
            index += 1


def _hf_rows(path: Path, split: str | None) -> Iterator[tuple[dict[str, Any], str]]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as err:
        raise DatasetError(f"{path}: folder is not a saved HF dataset ({err})") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = sorted(loaded.keys())
        if split is None:
            if len(splits) != 1:
                raise DatasetError(f"{path}: dataset has splits {splits}; pass split=... to choose one")
            split = splits[0]
        if split not in loaded:
            raise DatasetError(f"{path}: no split {split!r}; available splits: {splits}")
        dataset, label = loaded[split], f"{path}/{split}"
    else:
        if split is not None:
            raise DatasetError(f"{path}: split={split!r} given but the folder holds a single dataset without splits")
        dataset, label = loaded, str(path)
    for index, row in enumerate(dataset):
        yield row, f"{label}[{index}]"


def _to_example(row: dict[str, Any], where: str, prompt_field: str, answer_field: str) -> Example:
    for field_name in (prompt_field, answer_field):
        if field_name not in row:
            raise DatasetError(f"{where}: missing field {field_name!r}; the row has fields {sorted(row)}")
        if row[field_name] is None:
            raise DatasetError(f"{where}: field {field_name!r} is null; the row has fields {sorted(row)}")
    prompt = row[prompt_field]
    if not isinstance(prompt, str):
        raise DatasetError(f"{where}: field {prompt_field!r} must be a string, got {type(prompt).__name__}: {prompt!r}")
    answer = row[answer_field]
    if isinstance(answer, (dict, list)):
        answer = json.dumps(answer)
    elif not isinstance(answer, str):
        answer = str(answer)
    metadata = {key: value for key, value in row.items() if key not in (prompt_field, answer_field)}
    return Example(prompt=prompt, answer=answer, metadata=metadata, source=where)
