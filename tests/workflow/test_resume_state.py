"""What a checkpoint of an overlapped workflow carries (issue 15, item 2), on local queues: the rows generated
ahead of training come back bit for bit, with their weight versions (per token for partial rollouts), and
no worker takes them again; rows that do not match the re-fed prompts are refused; and a partition is
cleared once trained when replicas score their own rows (no reward task left waiting on it, so storage
does not grow over a run)."""

from __future__ import annotations

import json

import pytest
import torch

from asyncflow.config import build_config
from asyncflow.transfer import TransferQueue
from asyncflow.workers.trainer import TRAIN_COLUMNS
from asyncflow.workflow.ahead import decode_tensor, encode_tensor, read_rows, replay_rows
from asyncflow.workflow.pipeline import PipelineWorkflow

GROUP, GROUPS = 4, 3
PART = "step_5"


def feed(queue, groups=range(GROUPS)) -> list[int]:
    queue.create_partition(PART, num_rows=len(groups) * GROUP, group_size=GROUP)
    return queue.append(
        PART, {"prompt_ids": [torch.tensor([1, 2, g + 3]) for g in groups for _ in range(GROUP)]},
        group_ids=[g for g in groups for _ in range(GROUP)],
        metadata=[{"answer": str(g), "sample_index": k} for g in groups for k in range(GROUP)],
    )  # fmt: skip


def generate(queue, scored: bool) -> dict:
    """Write responses (random lengths and float32 log-probs; versions 3 and 4) the way replicas do."""
    gen = torch.Generator().manual_seed(0)
    meta = queue.request(PART, "rollout", ["prompt_ids"], GROUPS * GROUP)
    lengths = torch.randint(0, 6, (len(meta),), generator=gen).tolist()
    columns = {
        "response_ids": [torch.randint(3, 50, (n,), generator=gen) for n in lengths],
        "rollout_logprobs": [-torch.rand(n, generator=gen) * 7 for n in lengths],
    }
    if scored:
        columns["reward"] = torch.rand(len(meta), generator=gen)
    versions = [3 + i % 2 for i in range(len(meta))]
    reasons = ["stop" if n else "length" for n in lengths]
    rows_meta = [{"finish_reason": r} for r in reasons]
    for i, n in enumerate(lengths):
        if n >= 2 and versions[i] == 3:  # a partial rollout: its first token by version 3, the rest by 4
            rows_meta[i]["version_runs"] = [[0, 3], [1, 4]]
    assert any("version_runs" in m for m in rows_meta)
    queue.write(PART, meta.indices, columns, weight_version=versions, metadata=rows_meta)
    queue.ack(PART, "rollout", meta.indices)
    return {(g, m["sample_index"]): i for i, (g, m) in enumerate(zip(meta.group_ids, meta.metadata))}


def train_rows(queue) -> dict:
    meta = queue.request(PART, "train", TRAIN_COLUMNS, GROUPS * GROUP)
    batch = queue.get(meta)
    rows = {}
    for i, (g, m) in enumerate(zip(meta.group_ids, meta.metadata)):
        rows[(g, m["sample_index"])] = (
            batch.rows("response_ids")[i].tolist(), batch.rows("rollout_logprobs")[i].numpy().tobytes(),
            float(batch.data["reward"][i]), meta.weight_versions[i], m["finish_reason"], m["answer"],
            m.get("version_runs"),
        )  # fmt: skip
    return rows


def test_rows_generated_ahead_come_back_bit_for_bit_and_are_not_generated_again():
    tasks = ["rollout", "train"]
    before = TransferQueue.local(tasks=tasks)
    feed(before)
    generate(before, scored=True)
    saved = json.loads(json.dumps(read_rows(before, PART, GROUPS * GROUP, timeout=5)))  # through state.json
    expected = train_rows(before)  # reading for the checkpoint consumed nothing of the trainer's

    after = TransferQueue.local(tasks=tasks)
    feed(after)
    assert replay_rows(after, PART, saved, tasks, timeout=5) == GROUPS * GROUP
    assert after.request(PART, "rollout", ["prompt_ids"], 1, timeout=1).indices == [], "nothing left to generate"
    assert train_rows(after) == expected


def test_rows_are_not_scored_again_where_a_reward_worker_runs():
    tasks = ["rollout", "reward", "train"]
    before = TransferQueue.local(tasks=tasks)
    feed(before)
    meta = before.request(PART, "rollout", ["prompt_ids"], GROUPS * GROUP)
    before.write(PART, meta.indices, {
        "response_ids": [torch.tensor([5])] * len(meta), "rollout_logprobs": [torch.tensor([-1.0])] * len(meta),
    }, weight_version=0)  # fmt: skip
    scored = before.request(PART, "reward", ["response_ids"], GROUPS * GROUP)
    before.write(PART, scored.indices, {"reward": torch.ones(len(scored))})
    saved = read_rows(before, PART, GROUPS * GROUP, timeout=5)
    after = TransferQueue.local(tasks=tasks)
    feed(after)
    replay_rows(after, PART, saved, tasks, timeout=5)
    assert after.request(PART, "reward", ["response_ids"], 1, timeout=1).indices == []


def test_rows_of_other_prompts_are_refused():
    queue = TransferQueue.local(tasks=["rollout", "train"])
    feed(queue)
    generate(queue, scored=True)
    saved = read_rows(queue, PART, GROUPS * GROUP, timeout=5)
    other = TransferQueue.local(tasks=["rollout", "train"])
    feed(other, groups=range(1, GROUPS + 1))
    with pytest.raises(ValueError, match="do not match the prompts fed again"):
        replay_rows(other, PART, saved, ["rollout", "train"], timeout=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8])
def test_tensors_survive_json(dtype):
    tensor = (torch.randn(3, 5) * 100).to(dtype)
    back = decode_tensor(json.loads(json.dumps(encode_tensor(tensor))))
    assert back.dtype == dtype and torch.equal(back, tensor)


class ScoringReplicas:
    """The runtime surface PipelineWorkflow uses, with replicas that score their own rows (as under Ray)."""

    scores_in_rollout = True
    weight_sync = "inprocess"
    weight_sync_options: dict = {}

    def make_queue(self, tasks):
        return TransferQueue.local(tasks=tasks)


def test_trained_partitions_are_cleared_when_replicas_score_their_own_rows(tmp_path):
    config = build_config({}, [f"run.output_dir={tmp_path}", "workflow.mode=async"])
    workflow = PipelineWorkflow(config, runtime=ScoringReplicas(), trainer=None, prompts=None, policy_weights=dict,
                                rewards=None, timeline=None, scores_rows=False)
    queue = workflow.queue
    feed(queue)
    generate(queue, scored=True)
    for _ in queue.loader(PART, "train", TRAIN_COLUMNS, GROUP * GROUPS, timeout=5):
        pass
    assert queue.status(PART) == {"exists": False, "cleared": "consumed"}, "its rows are dropped from storage"
