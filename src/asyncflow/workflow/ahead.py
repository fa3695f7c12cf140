"""Rollouts generated ahead of training, as a checkpoint of an overlapped workflow carries them.

In `async` (and `stream`) the rollout side works on partitions the trainer has not reached yet, some
of them with weights older than the checkpointed policy. To resume exactly, a checkpoint keeps the
rows of those partitions that rollout has finished, and the resumed run writes them back instead of
generating them again with newer weights.

Owns: reading a finished partition's rows without consuming them for any worker (`read_rows`),
writing them into the same partition of a resumed run (`replay_rows`), and their JSON form
(`encode_tensor` / `decode_tensor`: raw little-endian bytes in base64, so float32 log-probs and
sampler states come back bit for bit).

Invariants:
- A row is identified by (group id, sample index); the resumed run re-feeds the partition from the
  same data cursor, so the prompts, group ids and sample indices match, or `replay_rows` refuses.
- Replayed rows keep their weight versions (per token too), their metadata (finish reason, an episode's turns
  and tool counts, an agent's calls) and their per-token columns (loss mask, an agent's own prompt ids), and
  are consumed and acknowledged for the rollout task (and the reward task, when it is registered), so no
  worker generates or scores them again; the trainer sees ordinary rows.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

import numpy as np
import torch

READER = "checkpoint"  # an unregistered task: reading as it never holds up clearing, and is reset after
ROW_COLUMNS = ["response_ids", "rollout_logprobs", "reward"]


def encode_tensor(tensor: torch.Tensor) -> dict:
    array = tensor.detach().cpu().contiguous().numpy()
    return {
        "dtype": str(array.dtype), "shape": list(array.shape),
        "data": base64.b64encode(array.astype(array.dtype.newbyteorder("<")).tobytes()).decode("ascii"),
    }  # fmt: skip


def decode_tensor(encoded: dict) -> torch.Tensor:
    dtype = np.dtype(encoded["dtype"]).newbyteorder("<")
    array = np.frombuffer(base64.b64decode(encoded["data"]), dtype=dtype).reshape(encoded["shape"])
    return torch.from_numpy(array.astype(array.dtype.newbyteorder("="), copy=True))


def read_rows(queue, partition: str, num_rows: int, timeout: float, *, columns: Sequence[str] = ()) -> dict:
    """Every row of a partition whose `ROW_COLUMNS` and extra per-token `columns` (a multi-turn row's
    `loss_mask`, an agent's `agent_prompt_ids`) are all written, as JSON-able data with each row's metadata;
    consumes nothing for the workers (the reading task is reset afterwards)."""
    meta = queue.request(partition, READER, ROW_COLUMNS + list(columns), num_rows, timeout=timeout)
    if len(meta) != num_rows:
        raise RuntimeError(f"checkpoint: read {len(meta)} of the {num_rows} finished rows of {partition!r}")
    batch = queue.get(meta)
    queue.reset(partition, READER)
    return {
        "group_ids": list(meta.group_ids),
        "sample_index": [m["sample_index"] for m in meta.metadata],
        "weight_version": list(meta.weight_versions),
        "metadata": [dict(m) for m in meta.metadata],  # the prompt's and what rollout wrote (finish reason, ...)
        "response_lengths": batch.lengths["response_ids"].tolist(),
        "response_ids": encode_tensor(batch.data["response_ids"]),
        "rollout_logprobs": encode_tensor(batch.data["rollout_logprobs"]),
        "reward": encode_tensor(batch.data["reward"]),
        "columns": {
            name: {"lengths": batch.lengths[name].tolist(), "data": encode_tensor(batch.data[name])} for name in columns
        },
    }


def row_metadata(rows: dict, i: int) -> dict:
    """The row metadata of row `i` of `read_rows` (checkpoints written before whole metadata was kept carry
    the finish reason and, after partial rollouts, `version_runs` only)."""
    if "metadata" in rows:
        return rows["metadata"][i]
    runs = rows.get("version_runs", [None] * len(rows["group_ids"]))[i]
    return {"finish_reason": rows["finish_reason"][i], **({"version_runs": runs} if runs else {})}


def saved_columns(rows: dict) -> dict[str, list[torch.Tensor]]:
    """The extra per-token columns of `read_rows`, a tensor per row (older checkpoints: `loss_mask` only)."""
    columns = rows.get("columns")
    if columns is None:
        lengths = rows["response_lengths"]
        columns = {"loss_mask": {"lengths": lengths, "data": rows["loss_mask"]}} if "loss_mask" in rows else {}
    return {name: list(decode_tensor(c["data"]).split(c["lengths"])) for name, c in columns.items()}


def replay_rows(queue, partition: str, rows: dict, tasks: Sequence[str], timeout: float) -> int:
    """Write rows from `read_rows` into the freshly fed `partition` of a resumed run; returns their count."""
    n = len(rows["group_ids"])
    meta = queue.request(partition, "rollout", ["prompt_ids"], n, timeout=timeout, consumer=READER)
    here = [(g, m["sample_index"]) for g, m in zip(meta.group_ids, meta.metadata)]
    saved = {key: i for i, key in enumerate(zip(rows["group_ids"], rows["sample_index"]))}
    if len(meta) != n or set(here) != set(saved):
        raise ValueError(
            f"checkpoint: the rows saved for {partition!r} do not match the prompts fed again "
            f"(saved groups {sorted(set(rows['group_ids']))[:8]}, fed {sorted({g for g, _ in here})[:8]}): "
            "did the data or the config change?"
        )
    order = [saved[key] for key in here]
    lengths = rows["response_lengths"]
    responses = decode_tensor(rows["response_ids"]).split(lengths)
    logprobs = decode_tensor(rows["rollout_logprobs"]).split(lengths)
    rewards = decode_tensor(rows["reward"])
    columns = {"response_ids": [responses[i] for i in order], "rollout_logprobs": [logprobs[i] for i in order],
               "reward": rewards[order]}
    for name, values in saved_columns(rows).items():
        columns[name] = [values[i] for i in order]
    queue.write(
        partition, meta.indices, columns,
        weight_version=[rows["weight_version"][i] for i in order],
        metadata=[row_metadata(rows, i) for i in order],
    )  # fmt: skip
    queue.ack(partition, "rollout", meta.indices)
    if "reward" in tasks:
        scored = queue.request(partition, "reward", ["response_ids"], n, timeout=timeout, consumer=READER)
        queue.ack(partition, "reward", scored.indices)
    return n
