"""`asyncflow profile`: measure this machine's cost functions for a config's model, with the project's engines.

Owns: `measure_profile(config)` -> a `kind: measured` `Profile`. What it times, each by least squares over a
small grid (median of `repeats`):
- generation with the configured inference engine (torch) at no stop token, so every row decodes exactly T
  tokens: total = prefill_token_s * prompt tokens + T * (decode_step_s + B * (decode_row_s + context *
  decode_row_token_s)), over batch sizes B up to `rollout.max_batch_size` and two lengths;
- a training micro-batch (the configured training engine's `backward_micro_batch`, the tri-model forward
  included) against its tokens (rows x (prompt + response), equal lengths, so no padding), at a quarter of and
  at `train.micro_batch_size` rows, after a warm-up call; and one optimizer step;
- a weight version: the trainer's `state_dict` loaded into the inference engine (`update_weights`), per byte;
- one TransferQueue write of `WRITE_ROWS` rows (in-process queue).
Scoring is not timed (`reward_row_s` = 0): the built-in verifiers cost microseconds a row.

Invariants: runs in the calling process only (profile in a process of its own, not beside a benchmark: the
two would share cores); it writes nothing but the returned profile; coefficients are clipped at 0.
"""

from __future__ import annotations

import platform
import time

import numpy as np
import torch

from asyncflow.config import Config
from asyncflow.engines.base import GenerationRequest, SamplingParams, make_train_engine
from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.models.loading import load_model, resolve_model_path
from asyncflow.models.logprobs import TrainSample
from asyncflow.plan.costs import Profile
from asyncflow.transfer import TransferQueue
from asyncflow.workers.rollout import WRITE_ROWS
from asyncflow.workflow.setup import train_engine_options


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _fit(features: list[list[float]], seconds: list[float]) -> np.ndarray:
    coef, *_ = np.linalg.lstsq(np.asarray(features, dtype=np.float64), np.asarray(seconds), rcond=None)
    return np.clip(coef, 0.0, None)


def measure_generation(engine: TorchInferenceEngine, *, prompt: int, batches: list[int], lengths: list[int],
                       repeats: int, vocab: int) -> tuple[np.ndarray, list]:
    """Coefficients (prefill_token_s, decode_step_s, decode_row_s, decode_row_token_s) and the raw points."""
    rng = np.random.default_rng(0)
    features, seconds, points = [], [], []
    for B in batches:
        for T in lengths:
            requests = [GenerationRequest(i, rng.integers(3, vocab, prompt).tolist()) for i in range(B)]
            params = SamplingParams(max_new_tokens=T, stop_token_ids=())
            s = _median_time(lambda: list(engine.generate(iter(requests), params)), repeats)
            context = prompt + T / 2
            features.append([B * prompt, T, T * B, T * B * context])
            seconds.append(s)
            points.append({"batch": B, "new_tokens": T, "prompt": prompt, "seconds": s})
    return _fit(features, seconds), points


def measure_training(config: Config, policy, model_path, *, prompt: int, lengths: list[int], repeats: int,
                     vocab: int) -> tuple:
    """(train_micro_batch_s, train_token_s, optimizer_step_s, points, engine) with the configured training engine."""
    engine = make_train_engine(config.train.engine, **train_engine_options(config, policy, model_path))
    rows, G = config.train.micro_batch_size, config.rollout.group_size
    rng = np.random.default_rng(1)

    def loss_fn(out):
        return -(out.policy.logprobs * out.policy.mask).sum(), {}

    def batch(n: int, R: int) -> list[TrainSample]:
        return [TrainSample(rng.integers(3, vocab, prompt).tolist(), rng.integers(3, vocab, R).tolist(), i // G)
                for i in range(n)]

    engine.backward_micro_batch(batch(rows, lengths[0]), loss_fn)  # warm-up (allocator, lazy initialisation)
    features, seconds, points = [], [], []
    for n in sorted({max(G, rows // 4), rows}):
        for R in lengths:
            samples = batch(n, R)
            s = _median_time(lambda: engine.backward_micro_batch(samples, loss_fn), repeats)
            tokens = n * (prompt + R)
            features.append([1.0, tokens])
            seconds.append(s)
            points.append({"rows": n, "tokens": tokens, "seconds": s})
    fixed, per_token = _fit(features, seconds)
    optimizer = _median_time(lambda: engine.optimizer_step(), repeats)
    return float(fixed), float(per_token), optimizer, points, engine


def measure_profile(config: Config, *, repeats: int = 3, name: str = "") -> Profile:
    """This machine's costs for `config`'s model (see the module docstring)."""
    path = resolve_model_path(config.model.path, seed=config.run.seed)
    model = load_model(path, dtype=config.model.dtype)
    vocab = model.get_input_embeddings().num_embeddings
    inference = TorchInferenceEngine(load_model(path, dtype=config.model.dtype).eval().requires_grad_(False),
                                     max_batch_size=config.rollout.max_batch_size)
    prompt = 16
    top = config.rollout.max_batch_size
    batches = sorted({1, max(1, top // 8), max(1, top // 2), top})
    lengths = sorted({max(2, config.rollout.max_new_tokens // 2), config.rollout.max_new_tokens})
    list(inference.generate(iter([GenerationRequest(0, [3] * prompt)]), SamplingParams(max_new_tokens=4)))  # warm
    gen, gen_points = measure_generation(inference, prompt=prompt, batches=batches, lengths=lengths,
                                         repeats=repeats, vocab=vocab)
    fixed, per_token, optimizer, train_points, trainer = measure_training(
        config, model, path, prompt=prompt, lengths=sorted({4, max(8, config.rollout.max_new_tokens)}), repeats=repeats,
        vocab=vocab,
    )
    state = trainer.state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    versions = iter(range(1, 10_000))
    swap = _median_time(lambda: inference.update_weights(trainer.state_dict(), next(versions)), repeats)
    queue = TransferQueue.local(tasks=["rollout"])
    queue.create_partition("p", num_rows=WRITE_ROWS * repeats, group_size=1)
    indices = queue.append("p", {"prompt_ids": [torch.zeros(prompt, dtype=torch.int64)] * (WRITE_ROWS * repeats)})
    batches_written = iter(range(repeats))

    def write():
        start = next(batches_written) * WRITE_ROWS
        queue.write("p", indices[start : start + WRITE_ROWS],
                    {"response_ids": [torch.zeros(16, dtype=torch.int64)] * WRITE_ROWS}, weight_version=0)

    queue_call = _median_time(write, repeats)
    return Profile(
        kind="measured", name=name or platform.node(), model=str(config.model.path),
        prefill_token_s=float(gen[0]), decode_step_s=float(gen[1]), decode_row_s=float(gen[2]),
        decode_row_token_s=float(gen[3]), train_micro_batch_s=fixed, train_token_s=per_token,
        optimizer_step_s=optimizer, publish_s=0.0, publish_byte_s=swap / max(nbytes, 1), weight_bytes=nbytes,
        queue_call_s=queue_call,
        threads=torch.get_num_threads(),
        notes=f"measured with {torch.get_num_threads()} torch threads on {platform.processor() or platform.machine()}; "
              f"weights {nbytes / 1e6:.1f} MB; generation points {gen_points}; training points {train_points}",
    )  # fmt: skip
