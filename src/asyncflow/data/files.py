"""Load prompt/answer datasets from disk: JSONL, Parquet, or a saved Hugging Face dataset folder.

Owns: `load_examples`, `iter_examples` and `validate_data_file` (the whole file checked up front,
before any model is loaded; it applies exactly the checks of `load_examples`, which it shares).
Invariants:
- Every row becomes exactly one `Example`, in file order; nothing is skipped silently except
  blank JSONL lines.
- Every error is a `DatasetError` whose message starts with the file (and, for a row, its position:
  1-based line for JSONL, 0-based row index for Parquet and HF datasets) and says what is wrong:
  missing/null field (with the fields the row does have), a field of the wrong type, bad JSON (with
  its column), a non-object row, bytes that are not UTF-8 (with their line and column), or a file
  with no rows at all. No bare codec or parser error escapes.
- JSONL is UTF-8; a leading byte-order mark is ignored.
- Answers: strings are kept as is, numbers and booleans go through str(), lists/dicts through
  json.dumps (so a structured ground truth stays machine-readable); a null, NaN or infinite answer
  (a missing value in a Parquet float column) and a bytes answer are errors. Prompts must be
  strings. Every other field goes to `metadata` unchanged.
- `split` selects a split of an HF `DatasetDict`; it is an error for single files and for a
  folder holding one plain `Dataset`, rather than being ignored.
"""

from __future__ import annotations

import json
import math
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
    return list(iter_examples(path, prompt_field, answer_field, split))


def validate_data_file(
    path: str | Path,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    split: str | None = None,
) -> int:
    """Check every row of a data file without keeping it (as `load_examples` would, so a run can fail
    before loading a model); returns the number of rows. Raises `DatasetError` at the first bad row."""
    return sum(1 for _ in iter_examples(path, prompt_field, answer_field, split))


def iter_examples(
    path: str | Path,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    split: str | None = None,
) -> Iterator[Example]:
    """The examples of a data file one at a time; see the module invariants."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"{path}: no such file or folder")
    if path.is_dir():
        rows = _hf_rows(path, split)
    elif split is not None:
        raise DatasetError(f"{path}: split={split!r} only applies to a saved HF dataset folder, not a file")
    elif path.suffix == ".jsonl":
        rows = _jsonl_rows(path)
    elif path.suffix == ".parquet":
        rows = _parquet_rows(path)
    else:
        raise DatasetError(
            f"{path}: unsupported dataset format {path.suffix!r}; use .jsonl, .parquet or a saved HF dataset folder"
        )
    count = 0
    for row, where in rows:
        yield _to_example(row, where, prompt_field, answer_field)
        count += 1
    if count == 0:
        if path.is_file() and path.stat().st_size == 0:
            raise DatasetError(f"{path}: the file is empty (no rows)")
        raise DatasetError(f"{path}: no rows" + (" (only blank lines)" if path.suffix == ".jsonl" else ""))


def _decode_line(raw: bytes, path: Path, line_number: int) -> str:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        column = len(raw[: err.start].decode("utf-8", errors="replace")) + 1
        raise DatasetError(
            f"{path}:{line_number}: line {line_number} is not valid UTF-8 (byte 0x{raw[err.start]:02x} at column "
            f"{column}); a JSONL file must be UTF-8"
        ) from None
    return line[1:] if line_number == 1 and line.startswith("\ufeff") else line


def _jsonl_rows(path: Path) -> Iterator[tuple[dict[str, Any], str]]:
    with path.open("rb") as lines:
        for line_number, raw in enumerate(lines, start=1):
            line = _decode_line(raw, path, line_number)
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                row = json.loads(line.rstrip("\r\n"))  # else a cut-off line is reported at column 1
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
        try:
            answer = json.dumps(answer)
        except (TypeError, ValueError) as err:
            raise DatasetError(f"{where}: field {answer_field!r} cannot be written as JSON ({err})") from None
    elif isinstance(answer, float) and not math.isfinite(answer):
        raise DatasetError(f"{where}: field {answer_field!r} is {answer} (a missing value?); a ground truth must be "
                           "a string, a number, a list or an object")
    elif isinstance(answer, (bytes, bytearray)):
        raise DatasetError(f"{where}: field {answer_field!r} must be a string, a number, a list or an object, got "
                           f"bytes: {bytes(answer[:40])!r}")
    elif not isinstance(answer, str):
        answer = str(answer)
    metadata = {key: value for key, value in row.items() if key not in (prompt_field, answer_field)}
    return Example(prompt=prompt, answer=answer, metadata=metadata, source=where)
