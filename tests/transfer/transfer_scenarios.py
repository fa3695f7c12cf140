"""Scenarios every deployment of the TransferQueue must pass; the local and Ray test modules run them.
Queues under test are built with registered tasks ("rollout", "trainer")."""

import threading
import time

import pytest
import torch

from asyncflow.transfer import (
    ColumnSchemaError,
    ColumnSpec,
    FilledCellError,
    PartitionClosedError,
    TransferQueue,
    TransferTimeout,
    UnknownColumnError,
    UnknownRowError,
)


def prompts(lengths, start=0):
    return [torch.arange(start, start + n, dtype=torch.int64) for n in lengths]


def check_round_trip(q, p):
    """Appended and later-written columns, row fields, padded and unpadded reads all come back exactly."""
    ids = prompts([3, 1, 4])
    idx = q.append(p, {"ids": ids, "score": torch.tensor([0.5, 1.5, 2.5])}, group_ids=[7, 7, 8], metadata={"src": "a"})
    logprobs = [torch.randn(n, 2) for n in (2, 5, 1)]
    q.write(p, idx, {"lp": logprobs}, weight_version=[3, 4, 5], metadata=[{"len": 2}, None, {"len": 1}])
    q.seal(p)
    meta = q.request(p, "reader", ["ids", "lp", "score"], 3, timeout=10)
    assert meta.indices == idx and meta.group_ids == [7, 7, 8] and meta.weight_versions == [3, 4, 5]
    assert meta.lengths == {"ids": [3, 1, 4], "lp": [2, 5, 1], "score": [0, 0, 0]}
    assert meta.metadata == [{"src": "a", "len": 2}, {"src": "a"}, {"src": "a", "len": 1}]
    batch = q.get(meta)
    assert torch.equal(batch.data["ids"], torch.cat(ids)) and batch.lengths["ids"].tolist() == [3, 1, 4]
    assert all(torch.equal(a, b) for a, b in zip(batch.rows("lp"), logprobs))
    assert torch.equal(batch.data["score"], torch.tensor([0.5, 1.5, 2.5])) and "score" not in batch.lengths
    padded = q.get(meta, ["lp"], padded=True, pad_value=-1.0)
    assert padded.data["lp"].shape == (3, 5, 2) and padded.data["lp"][2, 1:].eq(-1).all()
    assert all(torch.equal(a, b) for a, b in zip(padded.rows("lp"), logprobs))
    assert not q.request(p, "reader", ["ids"], 1, timeout=10)  # exhausted: empty meta, not a wait


def check_bad_inputs_rejected(q, p):
    """Each bad input is a clear error naming partition, row and column, and leaves the store as it was."""
    idx = q.append(p, {"ids": prompts([4, 2])})
    other = q.append(p, {"ids": prompts([3])})  # the next append goes to the next storage unit
    assert other[0] % q.num_storage_units != idx[0] % q.num_storage_units
    q.write(p, idx[:1], {"lp": [torch.randn(4)]})
    status = q.status(p)

    with pytest.raises(ColumnSchemaError, match=rf"partition '{p}' row \d+ column 'ids'.*float32"):
        q.append(p, {"ids": [torch.zeros(3)]})  # dtype conflicts with the column
    with pytest.raises(ColumnSchemaError, match=rf"partition '{p}' row {idx[1]} column 'lp'.*\[\*, 2\]"):
        q.write(p, idx[1:], {"lp": [torch.randn(2, 2)]})  # trailing shape conflicts
    with pytest.raises(ColumnSchemaError, match=rf"partition '{p}' column 'x' row {idx[1]}"):
        q.write(p, idx, {"x": [torch.zeros(2), torch.zeros(2, dtype=torch.float64)]})  # mixed inside one write
    with pytest.raises(FilledCellError, match=rf"partition '{p}' row {idx[0]} column 'lp': already written"):
        q.write(p, idx, {"lp": [torch.randn(4), torch.randn(2)]})
    with pytest.raises(FilledCellError, match=rf"partition '{p}' row {idx[0]} column 'lp': already written"):
        q.write(p, [other[0], idx[0]], {"lp": [torch.randn(3), torch.randn(4)]})  # spans two storage units
    with pytest.raises(TypeError, match=rf"partition '{p}' column 'ids' row #0"):
        q.append(p, {"ids": [[1, 2]]})
    never = rf"'{p}' with columns \['never'\].*row {idx[0]} lacks column\(s\) \['never'\]"
    with pytest.raises(TransferTimeout, match=never):
        q.request(p, "reader", ["never"], 1, timeout=0.2)
    assert q.metrics()["wait_max_s/reader"] >= 0.2, "the timed-out wait is recorded"
    assert q.status(p) == status
    meta = q.request(p, "reader", ["ids"], 2, timeout=10)
    with pytest.raises(UnknownColumnError, match=rf"partition '{p}' column 'lp'"):
        q.get(meta, ["lp"])  # not requested, so not known to be ready
    assert torch.equal(q.get(meta).data["ids"], torch.cat(prompts([4, 2])))
    assert q.get(q.request(p, "lp-reader", ["lp"], 1, timeout=10)).rows("lp")[0].shape == (4,)
    q.write(p, other, {"lp": [torch.randn(3)]})  # the failed two-unit write left nothing behind on either unit
    assert q.status(p)["ready"]["lp"] == 2

    closed = p + "-closed"
    q.create_partition(closed, columns={"ids": ColumnSpec(torch.int64)})
    with pytest.raises(UnknownColumnError, match=rf"partition '{closed}' row \d+ column 'other'"):
        q.append(closed, {"other": prompts([1])})
    with pytest.raises(UnknownColumnError, match=rf"partition '{closed}' column 'other'"):
        q.request(closed, "reader", ["other"], 1, timeout=1)
    (row,) = q.append(closed, {"ids": prompts([2])})
    with pytest.raises(UnknownColumnError, match=rf"partition '{closed}' row {row} column 'other'"):
        q.write(closed, [row], {"other": prompts([1])})
    assert q.status(closed)["ready"] == {"ids": 1}

    q.clear(p)
    with pytest.raises(PartitionClosedError, match=rf"row {idx[1]} column\(s\) lp of partition '{p}': it was cleared"):
        q.write(p, idx[1:], {"lp": [torch.randn(2)]})
    late = rf"append 1 rows \(rows \d+\.\.\d+, column\(s\) ids\) to partition '{p}': it was cleared"
    with pytest.raises(PartitionClosedError, match=late):
        q.append(p, {"ids": prompts([1])})


def check_unawaited_writes(q, p):
    """`write(..., wait=False)` returns before the round trip; its `wait()` makes the cells ready, or raises
    the write's error (a rejected write leaves nothing stored), and may be called again."""
    idx = q.append(p, {"ids": prompts([2, 3])}) + q.append(p, {"ids": prompts([1, 4])})
    lp = [torch.randn(n) for n in (2, 3, 1, 4)]
    one_unit = [i for i in idx if i % q.num_storage_units == idx[0] % q.num_storage_units]
    others = [i for i in idx if i not in one_unit]
    pending = [
        q.write(p, one_unit, {"lp": [lp[idx.index(i)] for i in one_unit]}, weight_version=1, wait=False),
        q.write(p, others, {"lp": [lp[idx.index(i)] for i in others]}, weight_version=2, wait=False),
    ]
    for write in pending + pending:
        write.wait()
    meta = q.request(p, "reader", ["lp"], 4, timeout=10)
    got = dict(zip(meta.indices, q.get(meta).rows("lp")))
    assert all(torch.equal(got[i], lp[idx.index(i)]) for i in idx)
    assert sorted(meta.weight_versions) == sorted(1 if i in one_unit else 2 for i in idx)

    (row,) = q.append(p, {"ids": prompts([2])})
    status = q.status(p)
    rejected = q.write(p, [row], {"lp": [torch.zeros(2, dtype=torch.float64)]}, wait=False)  # dtype conflict
    with pytest.raises(ColumnSchemaError, match=rf"partition '{p}' row {row} column 'lp'"):
        rejected.wait()
    assert q.status(p) == status
    q.write(p, [row], {"lp": [torch.ones(2)]}, wait=False).wait()
    assert q.status(p)["ready"]["lp"] == 5


def check_backpressure_ack_and_reset(q, p):
    """A full partition blocks its producer until both registered tasks acknowledged rows; once both
    acknowledged everything the partition and its data are gone; `reset` makes rows deliverable again."""
    q.create_partition(p, num_rows=3, capacity=2)
    first = q.append(p, {"ids": prompts([2, 2])})
    with pytest.raises(TransferTimeout, match=rf"partition '{p}' is full.*capacity 2"):
        q.append(p, {"ids": prompts([2])}, timeout=0.2)
    done = threading.Event()
    blocked = threading.Thread(target=lambda: (q.append(p, {"ids": prompts([2])}, timeout=20), done.set()))
    blocked.start()
    time.sleep(0.3)
    assert not done.is_set(), "producer should block while the partition is full"
    q.ack(p, "rollout", q.request(p, "rollout", ["ids"], 1, timeout=10).indices)
    trainer = q.request(p, "trainer", ["ids"], 1, timeout=10)
    assert trainer.indices == first[:1]
    time.sleep(0.3)
    assert not done.is_set(), "a row handed out but not acknowledged may still be read: it stays in flight"
    q.ack(p, "trainer", trainer.indices)
    blocked.join(timeout=20)
    assert done.is_set()
    # > 0, not >= the 0.6 s slept above: on a loaded machine the blocked append may reach the queue late
    assert q.metrics()["wait_max_s/backpressure"] > 0, "the blocked producer's wait is recorded"
    with pytest.raises(UnknownRowError, match=rf"partition '{p}' row {first[1]}: task 'trainer' acknowledged"):
        q.ack(p, "trainer", first[1:])

    again = q.request(p, "rollout", ["ids"], 2, timeout=10)
    q.reset(p, "rollout", again.indices[:1])  # e.g. the worker holding it failed
    assert q.request(p, "rollout", ["ids"], 1, timeout=10, ack=again.indices[1:]).indices == again.indices[:1]
    assert not q.request(p, "rollout", ["ids"], 1, timeout=10, ack=again.indices[:1])
    assert q.status(p)["exists"], "the trainer has not finished the partition"
    assert [len(b) for b in q.loader(p, "trainer", ["ids"], 2, timeout=10)] == [2]
    assert q.status(p) == {"exists": False, "cleared": "consumed"}
    assert not q.request(p, "trainer", ["ids"], 1, timeout=1), "a late worker of a registered task sees it exhausted"
    with pytest.raises(PartitionClosedError, match=rf"cannot request \(task 'reader'\) from partition '{p}'"):
        q.request(p, "reader", ["ids"], 1, timeout=1)
    with pytest.raises(UnknownRowError, match=rf"partition '{p}' row {first[0]} column 'ids': not stored"):
        q.get(trainer)  # the data was dropped from the storage units


def check_checkpoint_restores_into(q, p, fresh: TransferQueue, path):
    """State dict -> torch.save -> torch.load(weights_only=True) -> another queue continues where q stopped."""
    idx = q.append(p, {"ids": prompts([3, 5, 2])}, group_ids=[0, 0, 1], weight_version=2)
    q.write(p, idx[:2], {"reward": torch.tensor([1.0, 0.0])})
    q.ack(p, "trainer", q.request(p, "trainer", ["ids"], 1, timeout=10).indices)
    torch.save(q.state_dict(), path)
    fresh.load_state_dict(torch.load(path, weights_only=True))
    assert fresh.status(p) == q.status(p)
    assert fresh.status(p)["acked"] == {"trainer": 1} and fresh.status(p)["consumed"] == {"trainer": 1}
    meta = fresh.request(p, "trainer", ["ids", "reward"], 1, timeout=10)
    assert meta.indices == [idx[1]] and meta.weight_versions == [2]
    assert torch.equal(fresh.get(meta).data["ids"], torch.arange(5)) and fresh.get(meta).data["reward"].item() == 0.0
    with pytest.raises(FilledCellError):
        fresh.write(p, idx[:1], {"reward": torch.tensor([3.0])})
    (new,) = fresh.append(p, {"ids": prompts([1])})
    assert new not in idx, "indices continue after the restored ones"
    assert max(fresh.status(p)["ready"].values()) == 4
