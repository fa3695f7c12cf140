"""The Ray deployment: the shared scenarios through actors, a checkpoint moved from Ray to in-process, and
Ray actors as concurrent producers, rollout workers and trainers, each holding a pickled copy of the client."""


import pytest
import torch
from transfer_scenarios import (
    check_backpressure_ack_and_reset,
    check_bad_inputs_rejected,
    check_checkpoint_restores_into,
    check_round_trip,
    check_unawaited_writes,
)

from asyncflow.transfer import TransferQueue

ray = pytest.importorskip("ray")
from asyncflow.transfer.ray_queue import RayTransferQueue  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_cluster")



@pytest.fixture(scope="module")
def queue(ray_cluster):
    q = RayTransferQueue.create(num_storage_units=2, tasks=("rollout", "trainer"), timeout=60)
    yield q
    q.shutdown()


def test_round_trip(queue):
    check_round_trip(queue, "round-trip")


def test_bad_inputs_rejected_with_the_same_errors(queue):
    check_bad_inputs_rejected(queue, "bad")


def test_unawaited_writes(queue):
    check_unawaited_writes(queue, "unawaited")


def test_backpressure_ack_and_reset(queue):
    check_backpressure_ack_and_reset(queue, "pressure")


def test_checkpoint_moves_from_ray_to_in_process(queue, tmp_path):
    fresh = TransferQueue.local(num_storage_units=2, tasks=("rollout", "trainer"), timeout=20)
    check_checkpoint_restores_into(queue, "ckpt", fresh, tmp_path / "ckpt.pt")


def _prompt(seed: int, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + i)
    return torch.randint(0, 32000, (int(torch.randint(50, 400, (1,), generator=g)),), generator=g)


@ray.remote(num_cpus=0, max_concurrency=2)
class Worker:
    """A Ray actor running two roles at once on its threads, each through its own pickled copy of the client."""

    def produce(self, q, partition, seed, rows, per_append):
        out = {}
        for start in range(0, rows, per_append):
            prompts = [_prompt(seed, i) for i in range(start, start + per_append)]
            out.update(zip(q.append(partition, {"prompt": prompts}, timeout=60), [p.tolist() for p in prompts]))
        return out

    def rollout(self, q, partition):
        seen = []
        for batch in q.loader(partition, "rollout", ["prompt"], 3, timeout=60):
            seen += batch.meta.indices
            responses = [p * 2 + 1 for p in batch.rows("prompt")]
            q.write(partition, batch.meta.indices, {"response": responses}, weight_version=3)
        return seen

    def train(self, q, partition, capacity):
        got, max_in_flight = [], 0
        for batch in q.loader(partition, "trainer", ["prompt", "response"], 4, timeout=60):
            assert batch.meta.weight_versions == [3] * len(batch), "a row reached the trainer before its response"
            pairs = zip(batch.meta.indices, batch.rows("prompt"), batch.rows("response"))
            got += [(i, p.tolist(), r.tolist()) for i, p, r in pairs]
            status = q.status(partition)
            max_in_flight = max(max_in_flight, status.get("in_flight", 0))
        assert max_in_flight <= capacity, f"{max_in_flight} rows in flight, capacity {capacity}"
        return got


def test_ray_actors_as_producers_and_consumers_get_every_row_once_intact(queue):
    """Three actors in their own processes: two producers, two rollout workers, two trainers, all concurrent."""
    producers, rows_each, capacity = 2, 24, 12
    queue.create_partition("actors", num_rows=producers * rows_each, capacity=capacity)
    a, b, c = (Worker.remote() for _ in range(3))
    seen_refs = [b.rollout.remote(queue, "actors"), c.rollout.remote(queue, "actors")]
    train_refs = [a.train.remote(queue, "actors", capacity), c.train.remote(queue, "actors", capacity)]
    produced = [w.produce.remote(queue, "actors", s, rows_each, 4) for s, w in enumerate((a, b))]
    written = {}
    for part in ray.get(produced, timeout=120):
        written.update(part)
    seen = [i for rows in ray.get(seen_refs, timeout=120) for i in rows]
    trained = [row for rows in ray.get(train_refs, timeout=120) for row in rows]
    assert len(written) == producers * rows_each
    assert sorted(seen) == sorted(written), "rollout: rows lost or delivered twice"
    assert sorted(i for i, _, _ in trained) == sorted(written), "trainer: rows lost or delivered twice"
    for i, prompt, response in trained:
        assert prompt == written[i] and response == [t * 2 + 1 for t in written[i]], f"row {i} corrupted"
    assert queue.status("actors") == {"exists": False, "cleared": "consumed"}
    metrics = queue.metrics()
    assert metrics["consumed/trainer/response"] >= producers * rows_each and metrics["bytes_read"] > 0
    for actor in (a, b, c):
        ray.kill(actor)
