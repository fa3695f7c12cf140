"""The in-process TransferQueue: shared scenarios, capacity policy, metrics, and a threaded RL-like pipeline
(producers, a rollout stage writing back, trainers) checked for exactly-once, intact delivery."""

import random
import threading
import time

import pytest
import torch
from transfer_scenarios import (
    check_backpressure_ack_and_reset,
    check_bad_inputs_rejected,
    check_checkpoint_restores_into,
    check_round_trip,
    check_unawaited_writes,
    prompts,
)

from asyncflow.transfer import CapacityError, GroupSampler, TransferQueue, TransferTimeout


def local_queue(**kwargs):
    return TransferQueue.local(num_storage_units=3, tasks=("rollout", "trainer"), timeout=20, **kwargs)


def test_round_trip():
    check_round_trip(local_queue(), "p")


def test_bad_inputs_rejected():
    check_bad_inputs_rejected(local_queue(), "p")


def test_unawaited_writes():
    check_unawaited_writes(local_queue(), "p")


def test_backpressure_ack_and_reset():
    check_backpressure_ack_and_reset(local_queue(), "p")


def test_checkpoint_restores_into_a_fresh_queue(tmp_path):
    check_checkpoint_restores_into(local_queue(), "p", local_queue(), tmp_path / "ckpt.pt")


def test_full_partition_with_error_policy_raises_at_once():
    q = local_queue(capacity=2, on_full="error")
    q.append("p", {"ids": prompts([1, 1])})
    with pytest.raises(CapacityError, match="partition 'p' is full: cannot append 1 rows, 2 in flight of capacity 2"):
        q.append("p", {"ids": prompts([1])})
    assert q.status("p")["rows"] == 2


def test_metrics_count_rows_per_column_and_task_wait_times_and_bytes():
    q = local_queue()
    idx = q.append("p", {"ids": prompts([3, 5])})
    late = threading.Timer(0.3, lambda: q.write("p", idx, {"reward": torch.tensor([1.0, 2.0])}))
    late.start()
    q.get(q.request("p", "trainer", ["ids", "reward"], 2, timeout=5))  # blocks until the reward is written
    q.get(q.request("p", "rollout", ["ids"], 1, timeout=5))
    late.join()
    m = q.metrics()
    assert m["produced/ids"] == 2 and m["produced/reward"] == 2 and m["rows_appended"] == 2
    assert m["consumed/trainer"] == 2 and m["consumed/trainer/ids"] == 2 and m["consumed/trainer/reward"] == 2
    assert m["consumed/rollout"] == 1 and m["consumed/rollout/ids"] == 1 and "consumed/rollout/reward" not in m
    assert m["bytes_written"] == 8 * 8 + 2 * 4 and m["bytes_read"] == m["bytes_written"] + 3 * 8
    assert m["waits/trainer"] == 1 and 0.25 <= m["wait_s/trainer"] == m["wait_max_s/trainer"] < 5
    assert m["waits/rollout"] == 1 and m["wait_s/rollout"] < 0.25


def test_group_loader_streams_groups_in_completion_order():
    q = local_queue()
    q.create_partition("p", num_rows=6, group_size=2)
    idx = q.append("p", {"ids": prompts([1] * 6)}, group_ids=[0, 0, 1, 1, 2, 2])
    loader = q.loader("p", "trainer", ["resp"], 2, sampler=GroupSampler(), timeout=5)
    for group in (2, 0, 1):  # responses of group 2 finish first
        q.write("p", idx[2 * group : 2 * group + 1], {"resp": prompts([2])})
        q.write("p", idx[2 * group + 1 : 2 * group + 2], {"resp": prompts([3])})
        assert next(loader).meta.group_ids == [group, group]
    assert list(loader) == []


def test_loader_asks_alive_while_waiting_and_keeps_acks_and_rows(monkeypatch):
    monkeypatch.setattr("asyncflow.transfer.client.ALIVE_CHECK_S", 0.05)
    q = local_queue()
    q.create_partition("p", num_rows=4)
    idx = q.append("p", {"ids": prompts([1] * 4)})
    checks = []

    def alive():
        checks.append(1)
        if len(checks) == 3:  # the producer comes back with two rows, later with the rest
            q.write("p", idx[:2], {"resp": prompts([2, 2])})
        if len(checks) == 6:
            q.write("p", idx[2:], {"resp": prompts([3, 3])})

    loader = q.loader("p", "trainer", ["resp"], 2, timeout=5, alive=alive)
    assert next(loader).meta.indices == idx[:2] and len(checks) == 3
    assert next(loader).meta.indices == idx[2:] and len(checks) == 6
    assert list(loader) == []
    assert q.status("p")["acked"]["trainer"] == 4, "acks sent with a request that then timed out are kept"

    def dead():
        raise RuntimeError("the producer died")

    q.create_partition("q", num_rows=1)
    q.append("q", {"ids": prompts([1])})
    with pytest.raises(RuntimeError, match="the producer died"):  # long before the 5 s timeout
        next(q.loader("q", "trainer", ["resp"], 1, timeout=5, alive=dead))


def test_prefetching_loader_reads_the_next_batch_while_the_caller_works_and_stops_when_closed():
    q = local_queue()
    q.create_partition("p", num_rows=6, group_size=2)
    idx = q.append("p", {"ids": prompts([1] * 6)}, group_ids=[0, 0, 1, 1, 2, 2])
    q.write("p", idx[:4], {"resp": prompts([2] * 4)})
    loader = q.loader("p", "trainer", ["resp"], 2, sampler=GroupSampler(), timeout=5, prefetch=True)
    first = next(loader)
    assert first.meta.group_ids == [0, 0] and [len(r) for r in first.rows("resp")] == [2, 2]
    deadline = time.monotonic() + 5
    while q.status("p")["consumed"]["trainer"] < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert q.status("p")["consumed"]["trainer"] == 4, "the second group is taken while the caller holds the first"
    assert next(loader).meta.group_ids == [1, 1]
    q.write("p", idx[4:], {"resp": prompts([3, 3])})
    assert [b.meta.group_ids for b in loader] == [[2, 2]]

    q.create_partition("q", num_rows=6, group_size=2)
    idx = q.append("q", {"ids": prompts([1] * 6)}, group_ids=[0, 0, 1, 1, 2, 2])
    q.write("q", idx, {"resp": prompts([2] * 6)})
    loader = q.loader("q", "trainer", ["resp"], 2, sampler=GroupSampler(), timeout=5, prefetch=True)
    next(loader)
    loader.close()  # the caller stops early: at most the batch after its one was taken
    time.sleep(0.3)
    assert q.status("q")["consumed"]["trainer"] in (2, 4)

    q.create_partition("r", num_rows=1)
    q.append("r", {"ids": prompts([1])})
    with pytest.raises(TransferTimeout, match="lacks column"):  # the producer thread's error reaches the caller
        next(q.loader("r", "trainer", ["resp"], 1, timeout=0.2, prefetch=True))


def test_threaded_pipeline_delivers_every_row_once_per_task_intact():
    """4 producers, 2 rollout threads (read prompt, write response), 2 trainer threads; capacity
    forces producers to wait for the trainers. Responses are a function of the prompt, so corruption shows."""
    q = local_queue()
    producers, rows_each, capacity = 4, 30, 16
    q.create_partition("step", num_rows=producers * rows_each, capacity=capacity)
    written, received, errors, lock = {}, {"rollout": [], "trainer": []}, [], threading.Lock()

    def guarded(fn, *args):
        try:
            fn(*args)
        except BaseException as err:  # surfaced by the assertion below
            errors.append(err)

    def produce(seed):
        rng = random.Random(seed)
        for _ in range(rows_each // 3):
            rows = [torch.randint(0, 1000, (rng.randint(1, 40),)) for _ in range(3)]
            for i, row in zip(q.append("step", {"prompt": rows}, timeout=20), rows):
                with lock:
                    written[i] = row

    def rollout():
        for batch in q.loader("step", "rollout", ["prompt"], 3, timeout=20):
            rows = batch.rows("prompt")
            with lock:
                received["rollout"] += batch.meta.indices
            outputs = {"response": [r * 2 + 1 for r in rows], "logprob": [r.float() / 7 for r in rows]}
            q.write("step", batch.meta.indices, outputs, weight_version=1)

    def train():
        for batch in q.loader("step", "trainer", ["prompt", "response", "logprob"], 4, timeout=20):
            assert batch.meta.weight_versions == [1] * len(batch)
            with lock:
                columns = [batch.rows(c) for c in ("prompt", "response", "logprob")]
                received["trainer"] += zip(batch.meta.indices, *columns)

    threads = [threading.Thread(target=guarded, args=(produce, s)) for s in range(producers)]
    threads += [threading.Thread(target=guarded, args=(fn,)) for fn in (rollout, rollout, train, train)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    assert sorted(received["rollout"]) == sorted(written) and len(written) == producers * rows_each
    assert sorted(i for i, *_ in received["trainer"]) == sorted(written)
    for i, prompt, response, logprob in received["trainer"]:
        assert torch.equal(prompt, written[i]) and torch.equal(response, written[i] * 2 + 1)
        assert torch.equal(logprob, written[i].float() / 7)
    assert q.status("step") == {"exists": False, "cleared": "consumed"}
    assert q.metrics()["waits/backpressure"] == producers * rows_each // 3  # one per append
