"""Benchmark: TransferQueue put/get throughput and produce->consume latency, asyncflow vs `transferqueue`.

Owns nothing the library imports. Workload: rows of a few hundred tokens (int64 ids and float32
log-probs of one random length in [200, 500)), 2 storage units everywhere. Systems, measured side
by side in one run on one Ray instance:
- `asyncflow local`: `TransferQueue.local` (threads, no processes);
- `asyncflow ray`: `RayTransferQueue.create` (async controller actor + 2 storage-unit actors);
- `transferqueue`: the PyPI package (`tq.init`: controller actor + 2 SimpleStorage actors over ZMQ,
  polling mode; it has no in-process deployment, so it is the reference for both of ours).
Phases: put N rows in batches of B (one producer), then get them back in batches of B (one
consumer; every row is checked against what was put); then latency: a consumer thread waits for
one row at a time and the producer puts it, timed from before the put to the consumer holding the
data. asyncflow's consumer blocks in `request`; transferqueue's polls `get_meta` every
`--poll-ms` (its blocking mode re-checks every 5 s).

    PYTHONPATH=src python benchmarks/bench_transfer.py --quick   # < 60 s
    PYTHONPATH=src python benchmarks/bench_transfer.py           # more rows and latency samples
    PYTHONPATH=src python benchmarks/bench_transfer.py --sync-step 30   # queue cost of one sync trainer step
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable

import torch

COLUMNS = ["ids", "lp"]


def make_rows(num: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(200, 500, (num,), generator=g).tolist()
    return [(torch.randint(0, 150_000, (n,), generator=g), torch.randn(n, generator=g)) for n in lengths]


def row_bytes(rows) -> int:
    return sum(ids.numel() * 8 + lp.numel() * 4 for ids, lp in rows)


class Asyncflow:
    def __init__(self, queue) -> None:
        self.q = queue

    def put(self, partition: str, rows) -> list[int]:
        return self.q.append(partition, {"ids": [r[0] for r in rows], "lp": [r[1] for r in rows]})

    def get(self, partition: str, task: str, batch_size: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        batch = self.q.get(self.q.request(partition, task, COLUMNS, batch_size, timeout=60))
        return list(zip(batch.meta.indices, batch.rows("ids"), batch.rows("lp")))

    def consumer(self) -> Callable[[str, str], list]:
        return lambda partition, task: self.get(partition, task, 1)


class TransferQueuePackage:
    def __init__(self, poll_s: float) -> None:
        os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")  # it warns on every put that 2 cores < 8 threads
        import transfer_queue as tq
        from tensordict import TensorDict

        self.tq, self.TensorDict, self.poll_s = tq, TensorDict, poll_s
        config = {"controller": {"polling_mode": True}, "backend": {"SimpleStorage": {"num_data_storage_units": 2}}}
        self.conf = tq.init(config)
        self.client = tq.get_client()

    def put(self, partition: str, rows) -> list[int]:
        nested = {
            c: torch.nested.nested_tensor([r[k] for r in rows], layout=torch.jagged) for k, c in enumerate(COLUMNS)
        }
        meta = self.client.put(data=self.TensorDict(nested, batch_size=[len(rows)]), partition_id=partition)
        return meta.global_indexes

    def _get(self, client, partition: str, task: str, batch_size: int, wait: bool) -> list:
        while True:
            meta = client.get_meta(
                data_fields=COLUMNS, batch_size=batch_size, partition_id=partition, mode="fetch", task_name=task
            )
            if meta.size or not wait:
                break
            time.sleep(self.poll_s)
        data = client.get_data(meta)
        return list(zip(meta.global_indexes, data["ids"].unbind(), data["lp"].unbind()))

    def get(self, partition: str, task: str, batch_size: int) -> list:
        return self._get(self.client, partition, task, batch_size, wait=False)

    def consumer(self) -> Callable[[str, str], list]:
        from transfer_queue import TransferQueueClient

        client = TransferQueueClient(client_id="bench-consumer", controller_info=self.conf.controller.zmq_info)
        client.initialize_storage_manager(manager_type="SimpleStorage", config=self.conf.backend.SimpleStorage)
        return lambda partition, task: self._get(client, partition, task, 1, wait=True)

    def close(self) -> None:
        self.tq.close()


def check(got: list, put: dict) -> None:
    assert len({i for i, _, _ in got}) == len(got) == len(put), "rows lost or duplicated"
    for index, ids, lp in got:
        assert torch.equal(ids, put[index][0]) and torch.equal(lp, put[index][1]), "data corrupted"


def throughput(system, rows, batch_size: int, tag: str) -> dict[str, float]:
    partition = f"tp-{tag}"
    start = time.perf_counter()
    put = {}
    for i in range(0, len(rows), batch_size):
        put.update(zip(system.put(partition, rows[i : i + batch_size]), rows[i : i + batch_size]))
    put_s = time.perf_counter() - start
    start = time.perf_counter()
    got = []
    while len(got) < len(rows):
        got += system.get(partition, "bench", batch_size)
    get_s = time.perf_counter() - start
    check(got, put)
    return {"put_rows_s": len(rows) / put_s, "get_rows_s": len(rows) / get_s}


def latency(system, rows, tag: str) -> list[float]:
    partition, consume = f"lat-{tag}", system.consumer()
    received, stamps, errors = threading.Event(), [], []

    def consumer() -> None:
        try:
            for _ in rows:
                got = consume(partition, "latency")
                stamps.append(time.perf_counter())
                assert len(got) == 1
                received.set()
        except BaseException as err:
            errors.append(err)
            received.set()

    thread = threading.Thread(target=consumer)
    thread.start()
    time.sleep(0.2)  # let the consumer start waiting
    samples = []
    for row in rows:
        received.clear()
        start = time.perf_counter()
        system.put(partition, [row])
        if not received.wait(30) or errors:
            raise RuntimeError(f"latency consumer failed: {errors}")
        samples.append(stamps[-1] - start)
    thread.join(30)
    return samples


def sync_step_traffic(steps: int, write_rows: int) -> dict[str, float]:
    """The queue traffic of one step of the synchronous trainer on the example config (32 prompts x 8 samples,
    8 response tokens), without any model: append the prompts, the rollout stage reads them in batches of
    128 and writes the completions back `write_rows` at a time (the rollout worker writes a group's worth,
    8), the reward stage reads and writes in batches of 128, the trainer reads complete groups. Returns the
    median milliseconds per phase and their total."""
    from asyncflow.transfer import GroupSampler, TransferQueue

    prompts_per_step, group, batch = 32, 8, 128
    q = TransferQueue.local(num_storage_units=2, tasks=["rollout", "reward", "train"])
    times: dict[str, list[float]] = {}
    response, logprobs = torch.arange(8), torch.full((8,), -0.5)
    for step in range(steps + 3):
        partition, n = f"step_{step}", prompts_per_step * group
        marks = [time.perf_counter()]
        q.create_partition(partition, num_rows=n, group_size=group)
        metadata = [{"answer": "12", "sample_index": i % group} for i in range(n)]
        prompts = [torch.arange(20) for _ in range(n)]
        q.append(partition, {"prompt_ids": prompts}, group_ids=[i // group for i in range(n)], metadata=metadata)
        marks.append(time.perf_counter())
        for b in q.loader(partition, "rollout", ["prompt_ids"], batch, timeout=10):
            for start in range(0, len(b), write_rows):
                rows = b.meta.indices[start : start + write_rows]
                columns = {"response_ids": [response] * len(rows), "rollout_logprobs": [logprobs] * len(rows)}
                metadata = [{"finish_reason": "length"}] * len(rows)
                q.write(partition, rows, columns, weight_version=step, metadata=metadata)
        marks.append(time.perf_counter())
        for b in q.loader(partition, "reward", ["response_ids"], batch, timeout=10):
            q.write(partition, b.meta.indices, {"reward": torch.zeros(len(b))})
        marks.append(time.perf_counter())
        columns = ["prompt_ids", "response_ids", "rollout_logprobs", "reward"]
        got = sum(len(b) for b in q.loader(partition, "train", columns, n, sampler=GroupSampler(), timeout=10))
        assert got == n
        marks.append(time.perf_counter())
        if step >= 3:  # warm-up steps not counted
            for name, start, end in zip(("append", "rollout", "reward", "train"), marks, marks[1:]):
                times.setdefault(name, []).append(1e3 * (end - start))
    result = {name: statistics.median(values) for name, values in times.items()}
    result["total"] = sum(result.values())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rows (finishes in < 60 s)")
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--latency-samples", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3, help="throughput runs per system (median reported)")
    parser.add_argument("--poll-ms", type=float, default=1.0, help="transferqueue consumer's polling interval")
    parser.add_argument("--systems", default="local,ray,tq")
    parser.add_argument(
        "--sync-step", type=int, default=0, metavar="STEPS",
        help="instead: time the in-process queue traffic of one synchronous trainer step (median of STEPS)",
    )  # fmt: skip
    parser.add_argument("--write-rows", type=int, default=8, help="rows per rollout write in --sync-step")
    args = parser.parse_args()
    if args.sync_step:
        result = sync_step_traffic(args.sync_step, args.write_rows)
        print(
            f"queue traffic of one sync trainer step (256 rows; rollout writes of {args.write_rows} rows), median of "
            f"{args.sync_step} steps: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in result.items())
        )
        return
    if args.quick:
        args.rows, args.latency_samples = 512, 30
    if args.rows % args.batch:
        parser.error("--rows must be a multiple of --batch (transferqueue only hands out full batches)")
    systems = args.systems.split(",")
    rows = make_rows(args.rows, seed=0)
    lat_rows = make_rows(args.latency_samples, seed=1)
    results: dict[str, dict[str, float]] = {}

    def run(name: str, system) -> None:
        throughput(system, rows[: 4 * args.batch], args.batch, name + "-warmup")
        runs = [throughput(system, rows, args.batch, f"{name}-{k}") for k in range(args.repeats)]
        result = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        samples = sorted(latency(system, lat_rows, name))
        result["lat_p50_ms"] = 1e3 * statistics.median(samples)
        result["lat_p90_ms"] = 1e3 * samples[int(0.9 * (len(samples) - 1))]
        results[name] = result

    if "local" in systems:
        from asyncflow.transfer import TransferQueue

        run("asyncflow local", Asyncflow(TransferQueue.local(num_storage_units=2)))
    if "ray" in systems or "tq" in systems:
        import ray

        ray.init(include_dashboard=False, num_cpus=4, log_to_driver=False)  # transferqueue's actors ask 1 CPU each
        try:
            if "ray" in systems:
                from asyncflow.transfer.ray_queue import RayTransferQueue

                queue = RayTransferQueue.create(num_storage_units=2)
                run("asyncflow ray", Asyncflow(queue))
                queue.shutdown()
            if "tq" in systems:
                package = TransferQueuePackage(args.poll_ms / 1e3)
                run("transferqueue (ray+zmq)", package)
                package.close()
        finally:
            ray.shutdown()

    row_kb = row_bytes(rows) / len(rows) / 1e3
    print(
        f"\n{args.rows} rows of {row_kb:.1f} KB avg (int64 ids + float32 logprobs, 200-500 tokens), "
        f"batch {args.batch}, "
        f"2 storage units, median of {args.repeats} runs; MB/s = rows/s x {row_kb:.1f} KB. "
        f"get = request + read per batch; latency: {args.latency_samples} samples"
    )
    header = (
        f"{'system':<26}{'put rows/s':>11}{'put MB/s':>10}{'get rows/s':>11}{'get MB/s':>10}"
        f"{'lat p50 ms':>11}{'lat p90 ms':>11}"
    )
    print(header + "\n" + "-" * len(header))
    for name, r in results.items():
        print(
            f"{name:<26}{r['put_rows_s']:>11.0f}{r['put_rows_s'] * row_kb / 1e3:>10.1f}{r['get_rows_s']:>11.0f}"
            f"{r['get_rows_s'] * row_kb / 1e3:>10.1f}{r['lat_p50_ms']:>11.2f}{r['lat_p90_ms']:>11.2f}"
        )
    reference = results.get("transferqueue (ray+zmq)")
    if reference:
        print("\nratios vs transferqueue (throughput: asyncflow / transferqueue, > 1 is faster; "
              "latency: transferqueue / asyncflow, > 1 is lower)")  # fmt: skip
        for name, r in results.items():
            if name != "transferqueue (ray+zmq)":
                print(
                    f"{name:<26}put x{r['put_rows_s'] / reference['put_rows_s']:.2f}   "
                    f"get x{r['get_rows_s'] / reference['get_rows_s']:.2f}   "
                    f"latency p50 x{reference['lat_p50_ms'] / r['lat_p50_ms']:.1f} lower   "
                    f"p90 x{reference['lat_p90_ms'] / r['lat_p90_ms']:.1f} lower"
                )


if __name__ == "__main__":
    main()
