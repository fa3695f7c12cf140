"""Benchmark: one training step (forward + backward of a policy-gradient loss) packed vs unpacked.

Owns nothing the library imports. Measures, on the current machine, the median wall and process CPU time of a
micro-batch of `--groups` GRPO groups (G responses sharing a prompt) through
`response_logprobs` (unpacked, every response row carries its prompt), `packed_response_logprobs`
(shared-prompt packing, gathered attention) and, with `--dense`, the alternative design of one
row per group with a dense `[T, T]` block mask through plain SDPA. Variants run interleaved in one
process so machine noise hits them alike. One torch thread by default: on a CPU shared with other
jobs, oversubscribed OpenMP threads make multi-threaded timings swing several-fold. With one thread,
process CPU time is the work done; wall time also counts the time other jobs held the cores, so on
a busy machine the CPU-time ratio is the steadier of the two. Tokens: the unpacked rows carry their
prompt G times (`N * (P + R)`); packed, each group is `P + G * R`.

    PYTHONPATH=src python benchmarks/bench_packing.py            # full (a few minutes on 2 cores)
    PYTHONPATH=src python benchmarks/bench_packing.py --quick    # < 90 s
    PYTHONPATH=src python benchmarks/bench_packing.py --device cuda --dtype bfloat16 --check --groups 8
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch

from asyncflow.models.loading import load_model, resolve_model_path
from asyncflow.models.logprobs import LogProbs, TrainSample, gather_token_logprobs, response_logprobs, response_mask
from asyncflow.models.packing import flash_attn_varlen_func, packed_response_logprobs
from asyncflow.models.tri_model import should_pack

SHAPES = [(512, 64, 8), (64, 256, 8)]  # (prompt tokens, response tokens, G)


def make_samples(prompt_len: int, response_len: int, group_size: int, groups: int, vocab: int) -> list[TrainSample]:
    rng = random.Random(0)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        for _ in range(group_size):
            samples.append(TrainSample(prompt, [rng.randrange(3, vocab) for _ in range(response_len)], g))
    return samples


def dense_block_mask_logprobs(model, samples: list[TrainSample]) -> LogProbs:
    """The rejected alternative: one row per group, `[B, 1, T, T]` bool block mask, stock SDPA."""
    groups: dict[int, list[TrainSample]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    rows = [(g[0].prompt_ids, [s.response_ids for s in g]) for g in groups.values()]
    T = max(len(p) + sum(map(len, rs)) for p, rs in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    pos = torch.zeros(len(rows), T, dtype=torch.long)
    segment = torch.full((len(rows), T), -2)  # -1 prompt, i >= 0 response i, -2 padding
    predictors, targets = [], []
    for b, (prompt, responses) in enumerate(rows):
        p, at = len(prompt), len(prompt)
        ids[b, :p], pos[b, :p], segment[b, :p] = torch.tensor(prompt), torch.arange(p), -1
        for i, r in enumerate(responses):
            ids[b, at : at + len(r)], pos[b, at : at + len(r)] = torch.tensor(r), torch.arange(p, p + len(r))
            segment[b, at : at + len(r)] = i
            predictors.append([b * T + p - 1] + [b * T + at + j for j in range(len(r) - 1)])
            targets.append(r)
            at += len(r)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    same = segment[:, :, None] == segment[:, None, :]
    to_prompt = segment[:, None, :] == -1
    mask = (causal & (same | to_prompt) & (segment[:, :, None] != -2)) | torch.eye(T, dtype=torch.bool)
    device = next(model.parameters()).device
    ids, pos, mask = ids.to(device), pos.to(device), mask.to(device)
    hidden_logits = model(input_ids=ids, position_ids=pos, attention_mask=mask[:, None]).logits.flatten(0, 1)
    L = max(map(len, targets))
    index = torch.tensor([p + [0] * (L - len(p)) for p in predictors], device=device)
    target = torch.tensor([t + [0] * (L - len(t)) for t in targets], device=device)
    valid = response_mask(samples, device)
    logprobs, _ = gather_token_logprobs(hidden_logits[index], target, 1.0, False)
    return LogProbs(logprobs.masked_fill(~valid, 0.0), valid)


def sync(model) -> None:
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


def train_step(model, samples, logprob_fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of forward + backward of a policy-gradient loss."""
    advantages = torch.linspace(-1, 1, len(samples), device=next(model.parameters()).device)[:, None]
    sync(model)
    wall, cpu = time.perf_counter(), time.process_time()
    out = logprob_fn(model, samples)
    loss = -(advantages * out.logprobs).sum() / out.mask.sum()
    loss.backward()
    sync(model)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    model.zero_grad(set_to_none=True)
    return wall, cpu


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_equal(model, samples) -> tuple[float, float]:
    """(log-prob, worst parameter-gradient) relative difference of packed vs unpacked on these samples."""
    results = []
    for fn in (response_logprobs, packed_response_logprobs):
        model.zero_grad(set_to_none=True)
        out = fn(model, samples)
        advantages = torch.linspace(-1, 1, len(samples), device=out.logprobs.device)[:, None]
        (-(advantages * out.logprobs).sum() / out.mask.sum()).backward()
        results.append((out.logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    model.zero_grad(set_to_none=True)
    (ref, ref_grads), (packed, grads) = results
    return rel_diff(packed, ref), max(rel_diff(grads[n], ref_grads[n]) for n in ref_grads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (< 90 s)")
    parser.add_argument("--dense", action="store_true", help="also time the dense block-mask design")
    parser.add_argument("--groups", type=int, default=2, help="groups per micro-batch")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--preset", default="small-llama")
    parser.add_argument(
        "--shape", action="append", help="PROMPT,RESPONSE,G (repeatable); default: 512,64,8 and 64,256,8"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--check", action="store_true", help="first print packed-vs-unpacked differences")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: repeatable on a shared CPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (2 if args.quick else 7)

    with tempfile.TemporaryDirectory() as cache:
        model = load_model(
            resolve_model_path(f"preset:{args.preset}", cache_dir=cache), dtype=args.dtype, device=args.device
        )
    model.train()
    variants = {"unpacked": response_logprobs, "packed": packed_response_logprobs}
    shapes = [tuple(int(x) for x in shape.split(",")) for shape in args.shape] if args.shape else SHAPES
    if args.dense:
        variants["dense-mask"] = dense_block_mask_logprobs
    print(
        f"preset={args.preset} device={args.device} dtype={args.dtype} threads={torch.get_num_threads()} "
        f"groups={args.groups} repeats={repeats} (medians); flash_attn varlen: {flash_attn_varlen_func is not None}"
    )
    if args.check:
        for prompt_len, response_len, group_size in shapes:
            samples = make_samples(prompt_len, response_len, group_size, args.groups, model.config.vocab_size)
            logprob_diff, grad_diff = check_equal(model, samples)
            print(
                f"check P={prompt_len} R={response_len} G={group_size}: rel diff log-probs {logprob_diff:.2e}, "
                f"worst parameter gradient {grad_diff:.2e}"
            )
    header = f"{'prompt':>6} {'resp':>5} {'G':>2} {'tok unpacked':>12} {'tok packed':>10} " + " ".join(
        f"{name + ' s':>13}" for name in variants
    )
    print(header + f" {'speed-up':>8} {'cpu: ' + ' / '.join(variants) + ' s':>28} {'speed-up':>8} {'should_pack':>11}")
    for prompt_len, response_len, group_size in shapes:
        samples = make_samples(prompt_len, response_len, group_size, args.groups, model.config.vocab_size)
        for fn in variants.values():  # warm-up
            train_step(model, samples, fn)
        walls: dict[str, list[float]] = {name: [] for name in variants}
        cpus: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(repeats):
            for name, fn in variants.items():
                wall, cpu = train_step(model, samples, fn)
                walls[name].append(wall)
                cpus[name].append(cpu)
        wall = {name: statistics.median(t) for name, t in walls.items()}
        cpu = {name: statistics.median(t) for name, t in cpus.items()}
        unpacked_tokens = len(samples) * (prompt_len + response_len)
        packed_tokens = args.groups * (prompt_len + group_size * response_len)
        wall_cells = " ".join(f"{wall[name]:13.3f}" for name in variants)
        cpu_cells = " / ".join(f"{cpu[name]:.3f}" for name in variants)
        print(
            f"{prompt_len:>6} {response_len:>5} {group_size:>2} {unpacked_tokens:>12} {packed_tokens:>10} {wall_cells} "
            f"{wall['unpacked'] / wall['packed']:>7.2f}x {cpu_cells:>28} {cpu['unpacked'] / cpu['packed']:>7.2f}x "
            f"{str(should_pack(samples)):>11}",
            flush=True,
        )


if __name__ == "__main__":
    main()
