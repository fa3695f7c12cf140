"""`asyncflow profile`: measure this machine's cost functions for a config's model, with the project's engines.

Owns: `measure_profile(config)` -> a `kind: measured` `Profile`. What it times, each by least squares over a
small grid (median of `repeats`):
- generation by a run's rollout worker on the torch inference engine at no stop token, so every row decodes
  exactly T tokens: total = prefill_token_s * prompt tokens + prefill_row_s * B + T * (decode_step_s + B * (decode_row_s
  + context * decode_row_token_s)), over batch sizes B up to `rollout.max_batch_size`, two lengths and two
  prompt lengths, 8 and 128 tokens (a prefill has a cost per row besides its tokens), fitted by relative error;
- a training micro-batch as a run trains it: complete rows read from the configured runtime's queue by the run's
  `PolicyTrainer` (its loader, the configured loss and engine, the tri-model forward included), against the
  micro-batches and tokens the trainer runs for a read (`engine_micro_batches`: equal lengths, split by
  `train.max_tokens_per_micro_batch` where set), at a quarter of and at `train.micro_batch_size` rows, after a
  warm-up, with distinct prompts (unpacked: `train_token_s`) and with groups sharing their prompt
  (shared-prompt packed: `train_packed_token_s`, dearer per token); and the trainer's optimizer step after a
  micro-batch. Under a token budget every micro-batch holds about the budget's tokens, so how a micro-batch's cost
  splits into its fixed and per-token parts is loosely determined; their sum at that size, what the simulator
  charges, is not;
- a weight version: the trainer's `state_dict` loaded into the inference engine (`update_weights`), per byte;
- the TransferQueue calls of one partition (`measure_queue_calls`), on the configured runtime's queue, and a
  step's prompts put there as the trainer puts them (`measure_put_prompts`);
- scoring a batch of responses with the configured reward functions (their isolation included), per row;
- on a CPU with `runtime.kind: ray`, where the roles and the data plane share this host's cores: the cores
  (`host_cores`), what the local cluster's processes take of them while idle (`background_cores`) and per queue
  call beside its caller (`queue_beside_call_s`).

Invariants: runs in the calling process only (profile in a process of its own, not beside a benchmark: the
two would share cores); it writes nothing but the returned profile; every coefficient is >= 0 (`nonnegative_fit`).
The policy, its trainer and the rollout engine live on `model.device` (the CPU or one CUDA GPU, as in a run), and
every wall-clock timing waits for the device's queued work before it reads the clock (`_sync`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from asyncflow.config import Config
from asyncflow.engines.base import (
    GenerationRequest,
    SamplingParams,
    TrainEngine,
    make_inference_engine,
    make_train_engine,
)
from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.models.loading import load_model, load_tokenizer, resolve_model_path
from asyncflow.plan.costs import Profile
from asyncflow.plan.sim import engine_micro_batches
from asyncflow.transfer import GroupSampler, TransferQueue
from asyncflow.workers.loops import partition_name
from asyncflow.workers.rollout import PROMPT_COLUMNS, WRITE_ROWS, RolloutWorker
from asyncflow.workers.trainer import TRAIN_COLUMNS, PolicyTrainer
from asyncflow.workflow.pipeline import feed_prompts
from asyncflow.workflow.setup import datasets, make_reward_worker, prompt_source, train_engine_options

CpuSeconds = Callable[[], tuple[float, float]]  # (this process's CPU seconds, the local cluster's processes')
Points = list[dict[str, Any]]

MICRO_BATCHES = 3  # per partition the trainer reads while timing a micro-batch (the loader prefetches the next)


def _sync(device: torch.device | str) -> None:
    """Wait for the work queued on `device` (a CUDA device runs kernels after the call that launched them
    returns): before a clock is read, so a timing holds the work it launched and none from before."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], object], repeats: int, device: torch.device | str = "cpu") -> float:
    times: list[float] = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def nonnegative_fit(features: list[list[float]], seconds: list[float], *, relative: bool = False) -> np.ndarray:
    """Least squares with every coefficient >= 0. A coefficient that comes out negative is fixed at 0 and the others
    are fitted again, until none is negative. Clipping it alone would leave the others fitted around its negative
    share, away from the measured points (BENCHMARKS.md, "The fit"). `relative`: minimise each point's error as a
    fraction of its seconds, for points that span orders of magnitude, where the noise of the largest would otherwise
    decide the coefficients that only the smallest show (a decode step beside a long prefill)."""
    X, y = np.asarray(features, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    if relative:
        X, y = X / y[:, None], np.ones_like(y)
    free = np.ones(X.shape[1], dtype=bool)
    while True:
        coef = np.zeros(X.shape[1])
        coef[free] = np.linalg.lstsq(X[:, free], y, rcond=None)[0]
        if (coef >= 0).all():
            return coef
        free[np.argmin(coef)] = False


def measure_generation(engine: TorchInferenceEngine, *, prompts: list[int], batches: list[int], lengths: list[int],
                       repeats: int, vocab: int) -> tuple[np.ndarray, Points]:
    """Coefficients (prefill_token_s, prefill_row_s, decode_step_s, decode_row_s, decode_row_token_s) and the
    raw points, each point a partition generated by the rollout worker of a run (prompts read from an in-process
    queue, finished rows written back)."""
    rng = np.random.default_rng(0)
    queue = TransferQueue.local(tasks=["rollout", "train"])  # rows stay until the trainer (absent) reads them
    features: list[list[float]] = []
    seconds: list[float] = []
    points: Points = []
    for P in prompts:
        for B in batches:
            for T in lengths:
                worker = RolloutWorker(engine, SamplingParams(max_new_tokens=T, stop_token_ids=()), group_size=1)
                names = iter(f"p{P}_{B}_{T}_{i}" for i in range(repeats))

                def partition() -> None:
                    name = next(names)
                    queue.create_partition(name, num_rows=B, group_size=1)
                    queue.append(name, {"prompt_ids": [torch.from_numpy(rng.integers(3, vocab, P)) for _ in range(B)]})
                    worker.run_partition(queue, name, batch_size=max(batches), timeout=600)
                    queue.clear(name)

                s = _median_time(partition, repeats, engine.device)
                features.append([B * P, B, T, T * B, T * B * (P + T / 2)])
                seconds.append(s)
                points.append({"batch": B, "new_tokens": T, "prompt": P, "seconds": round(s, 5)})
    return nonnegative_fit(features, seconds, relative=True), points


def measure_training(
    config: Config, policy: torch.nn.Module, model_path: str | Path, queue: TransferQueue, *, prompt: int,
    lengths: list[int], repeats: int, vocab: int,
) -> tuple[float, float, float | None, float, Points, TrainEngine]:
    """(train_micro_batch_s, train_token_s, train_packed_token_s, optimizer_step_s, points, engine): micro-batches
    as a run trains them: complete rows (the columns a rollout worker writes) read from `queue` and trained by the
    run's `PolicyTrainer.train_partition` (its loader prefetching the next micro-batch while one trains; the
    configured loss and engine), `MICRO_BATCHES` reads per partition, with distinct prompts (unpacked) and with
    groups sharing their prompt (packed as `train.packing` decides), each read against the micro-batches and tokens
    `engine_micro_batches` counts (a read split by `train.max_tokens_per_micro_batch` as the trainer splits it);
    and the trainer's `finish_step` (the optimizer step) after each partition. On `model.device`, each timing waits
    for the device's queued work (`_sync`)."""
    device = config.model.device
    engine = make_train_engine(config.train.engine, **train_engine_options(config, model_path, policy))
    rows, G = config.train.micro_batch_size, config.rollout.group_size
    trainer = PolicyTrainer(engine, config.algo, micro_batch_size=rows, temperature=config.rollout.temperature,
                            max_tokens_per_micro_batch=config.train.max_tokens_per_micro_batch)
    can_pack = config.train.packing != "off"
    budget = config.train.max_tokens_per_micro_batch
    rng = np.random.default_rng(1)
    names = (f"train_{i}" for i in itertools.count())
    optimizer: list[float] = []  # each after a partition's gradients, as in a run (AdamW skips parameters without)

    def train(n: int, R: int, shared: bool) -> float:
        """Seconds per read of `n` rows of `R` response tokens, over a partition of `MICRO_BATCHES` reads; then
        the optimizer step, timed into `optimizer`."""
        name, total = next(names), n * MICRO_BATCHES
        prompts = [torch.from_numpy(rng.integers(3, vocab, prompt)) for _ in range(total // G if shared else total)]
        queue.create_partition(name, num_rows=total, group_size=G)
        indices = queue.append(name, {"prompt_ids": [prompts[i // G if shared else i] for i in range(total)]},
                               group_ids=[i // G for i in range(total)],
                               metadata=[{"answer": "0", "sample_index": i % G} for i in range(total)])
        queue.write(name, indices, {"response_ids": [torch.from_numpy(rng.integers(3, vocab, R)) for _ in indices],
                                    "rollout_logprobs": [torch.full((R,), -1.0) for _ in indices],
                                    "reward": torch.from_numpy(rng.standard_normal(total).astype(np.float32))},
                    weight_version=[0] * total)  # fmt: skip
        _sync(device)
        t0 = time.perf_counter()
        trainer.train_partition(queue, name, policy_version=0, max_staleness=0, group_size=G,
                                groups_per_batch=max(1, n // G), max_new_tokens=R, timeout=120, sampler=GroupSampler())
        _sync(device)
        seconds = (time.perf_counter() - t0) / MICRO_BATCHES
        queue.clear(name)
        optimizer.append(_median_time(trainer.finish_step, 1, device))
        return seconds

    train(rows, lengths[0], can_pack)  # warm-up (allocator, lazy initialisation, the loader's first calls)
    optimizer.clear()  # the first step also creates AdamW's state
    features: list[list[float]] = []
    seconds: list[float] = []
    points: Points = []
    for shared in sorted({False, can_pack}):
        for n in sorted({max(G, rows // 4), rows}):
            for R in lengths:
                pieces = engine_micro_batches(np.full(n, prompt), np.full(n, R), G, budget, shared_prompts=shared)
                s = float(np.median([train(n, R, shared) for _ in range(repeats)]))
                features.append([float(len(pieces)), sum(t for t, packed in pieces if not packed),
                                 sum(t for t, packed in pieces if packed)])
                seconds.append(s)
                points.append({"rows": n, "micro_batches": len(pieces), "tokens": sum(t for t, _ in pieces),
                               "packed": pieces[0][1], "seconds": round(s, 5)})
    fixed, per_token, per_packed_token = nonnegative_fit(features, seconds)
    return (float(fixed), float(per_token), float(per_packed_token) if can_pack else None,
            float(np.median(optimizer)), points, engine)


def measure_queue_calls(
    config: Config, queue: TransferQueue, cpu_s: CpuSeconds, *, prompt: int, repeats: int
) -> tuple[float, float]:
    """CPU seconds one TransferQueue call of a partition's life costs on `queue` (the configured runtime's, see
    `run_queue`): a step's prompts appended, read by the rollout `rollout.max_batch_size` at a time, its responses
    written `WRITE_ROWS` at a time while the trainer waits for `train.micro_batch_size` complete rows at a time
    (each write wakes its request), as in a run. Returns (all of it, the local cluster's processes' share: what
    the queue's actors and Ray's own processes spend beside the caller, on cores a shared host's roles want)."""
    rows, G = config.rollout.prompts_per_step * config.rollout.group_size, config.rollout.group_size
    rng = np.random.default_rng(3)

    def read_all(name: str) -> int:
        return sum(1 for _ in queue.loader(name, "train", TRAIN_COLUMNS, config.train.micro_batch_size, timeout=60))

    def partition(name: str) -> int:
        queue.create_partition(name, num_rows=rows, group_size=G)
        prompts = [torch.from_numpy(rng.integers(3, 40, prompt)) for _ in range(rows // G) for _ in range(G)]
        indices = queue.append(name, {"prompt_ids": prompts}, metadata=[{"answer": "0"}] * rows)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            trainer_reads = pool.submit(read_all, name)
            calls = 1 + sum(1 for _ in queue.loader(name, "rollout", PROMPT_COLUMNS, config.rollout.max_batch_size,
                                                    timeout=60))  # fmt: skip
            for start in range(0, rows, WRITE_ROWS):
                done = indices[start : start + WRITE_ROWS]
                queue.write(name, done, {"response_ids": [torch.zeros(8, dtype=torch.int64)] * len(done),
                                         "rollout_logprobs": [torch.zeros(8)] * len(done),
                                         "reward": torch.zeros(len(done))}, weight_version=[0] * len(done))
                calls += 1
            calls += trainer_reads.result(timeout=120)
        queue.clear(name)
        return calls

    partition("warm-up")
    own0, cluster0 = cpu_s()
    calls = sum(partition(f"p{i}") for i in range(repeats))
    own, cluster = cpu_s()
    return (own - own0 + cluster - cluster0) / calls, (cluster - cluster0) / calls


def measure_put_prompts(
    config: Config, queue: TransferQueue, tokenizer: PreTrainedTokenizerBase, *, repeats: int
) -> float:
    """Wall seconds the trainer takes to put a step's prompts on `queue` as a run does (`PipelineWorkflow.
    put_prompts`: the configured prompt source's next batch, encoded, then its partition created and appended):
    on the trainer's path every step, and several queue calls' worth (its rows travel in one append)."""
    train_set, _ = datasets(config)
    prompts = prompt_source(config, tokenizer, train_set)
    seconds = []
    for step in range(repeats + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        feed_prompts(queue, step, prompts.next_prompts(config.rollout.prompts_per_step), config.rollout.group_size)
        seconds.append(time.perf_counter() - t0)
        queue.clear(partition_name(step))
    return float(np.median(seconds[1:]))


def measure_background(cpu_s: CpuSeconds, seconds: float = 4.0) -> float:
    """Cores the runtime's processes take while nothing is asked of them: the CPU `cpu_s` counts (this process and
    the local cluster's, see `run_queue`) over `seconds` of waiting, per second."""
    t0, c0 = time.perf_counter(), sum(cpu_s())
    time.sleep(seconds)
    return (sum(cpu_s()) - c0) / (time.perf_counter() - t0)


@contextlib.contextmanager
def run_queue(config: Config) -> Iterator[tuple[TransferQueue, CpuSeconds]]:
    """(queue, cpu_s) of the configured runtime. `cpu_s()`: (this process's CPU seconds, the local cluster's
    processes' CPU seconds): an in-process queue (the second always 0), or for `runtime.kind: ray` the queue's
    actors on a Ray session."""
    tasks = ["rollout", "train"]
    if config.runtime.kind != "ray":
        yield TransferQueue.local(tasks=tasks), lambda: (time.process_time(), 0.0)
        return
    import psutil

    from asyncflow.runtime.ray_runtime import ray_session
    from asyncflow.transfer.ray_queue import RayTransferQueue

    def with_cluster_cpu_s() -> tuple[float, float]:  # this process, and its descendants: the local cluster's
        children = psutil.Process().children(recursive=True)
        return time.process_time(), sum(sum(child.cpu_times()[:2]) for child in children)

    with ray_session(address=config.runtime.address, num_cpus=config.runtime.num_cpus):
        yield RayTransferQueue.create(num_storage_units=config.runtime.storage_units, tasks=tasks), with_cluster_cpu_s


def measure_profile(config: Config, *, repeats: int = 5, name: str = "") -> Profile:
    """This machine's costs for `config`'s model (see the module docstring)."""
    path = resolve_model_path(config.model.path, seed=config.run.seed)
    device = torch.device(config.model.device)
    model = load_model(path, dtype=config.model.dtype, device=config.model.device)  # the trained policy, as a run's
    vocab = cast(torch.nn.Embedding, model.get_input_embeddings()).num_embeddings
    # the rollout engine as a run builds its torch engine (`rollout_spec`, `build_rollout_worker`): its dtype
    # `config.rollout_dtype()` (bfloat16 under `train.precision: bf16`), on `model.device`
    inference = cast(TorchInferenceEngine, make_inference_engine(
        "torch", model_path=str(path), dtype=config.rollout_dtype(), device=config.model.device,
        max_batch_size=config.rollout.max_batch_size, seed=config.run.seed,
    ))  # the registry's "torch" engine
    prompt = 16
    top = config.rollout.max_batch_size
    batches = sorted({1, max(1, top // 8), max(1, top // 2), top})
    lengths = sorted({max(2, config.rollout.max_new_tokens // 2), config.rollout.max_new_tokens})
    list(inference.generate(iter([GenerationRequest(0, [3] * prompt)]), SamplingParams(max_new_tokens=4)))  # warm
    # prompts of 8 and 128 tokens (within data.max_prompt_tokens): a prefill long enough to stand out of a tiny
    # model's per-step overhead, and a range that brackets a task's prompts rather than extrapolating to them
    longest = max(prompt, min(8 * prompt, config.data.max_prompt_tokens))
    gen, gen_points = measure_generation(inference, prompts=[prompt // 2, longest], batches=batches,
                                         lengths=lengths, repeats=repeats, vocab=vocab)
    with run_queue(config) as (queue, cpu_s):
        fixed, per_token, per_packed_token, optimizer, train_points, trainer = measure_training(
            config, model, path, queue, prompt=prompt, lengths=sorted({4, max(8, config.rollout.max_new_tokens)}),
            repeats=repeats, vocab=vocab,
        )
        queue_call, queue_beside = measure_queue_calls(config, queue, cpu_s, prompt=prompt, repeats=repeats)
        put_prompts = measure_put_prompts(config, queue, load_tokenizer(path), repeats=repeats)
        shared_host = config.runtime.kind == "ray" and config.model.device == "cpu"
        background = measure_background(cpu_s) if shared_host else 0.0
    state = trainer.state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    versions = iter(range(1, 10_000))
    swap = _median_time(lambda: inference.update_weights(trainer.state_dict(), next(versions)), repeats,
                        inference.device)
    rewards = make_reward_worker(config)
    responses = np.random.default_rng(2).integers(3, vocab, (top, 8)).tolist()
    reward_row = _median_time(lambda: rewards.score_ids(responses, [{"answer": "0"}] * top), repeats) / top
    rewards.runner.close()
    gpu = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    return Profile(
        kind="measured", name=name or platform.node(), model=str(config.model.path),
        prefill_token_s=float(gen[0]), prefill_row_s=float(gen[1]), decode_step_s=float(gen[2]),
        decode_row_s=float(gen[3]), decode_row_token_s=float(gen[4]), train_micro_batch_s=fixed,
        train_token_s=per_token, train_packed_token_s=per_packed_token,
        optimizer_step_s=optimizer, publish_s=0.0, publish_byte_s=swap / max(nbytes, 1), weight_bytes=nbytes,
        queue_call_s=queue_call, put_prompts_s=put_prompts, reward_row_s=reward_row,
        host_cores=len(os.sched_getaffinity(0)) if shared_host else 0.0, background_cores=background,
        queue_beside_call_s=queue_beside if shared_host else 0.0,
        threads=torch.get_num_threads(),
        notes=f"measured on {device}{gpu} with {torch.get_num_threads()} torch threads on "
              f"{platform.processor() or platform.machine()}; "
              f"rollout weights {config.rollout_dtype()}, training precision {config.train.precision}; "
              f"weights {nbytes / 1e6:.1f} MB; generation points {gen_points}; training points {train_points}",
    )  # fmt: skip
