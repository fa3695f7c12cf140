"""Benchmark: peak memory and time of one training step with and without bf16 mixed precision and activation
checkpointing (the built-in `torch` engine), side by side.

Owns nothing the library uses. Four modes, `fp32`, `fp32+ckpt`, `bf16`, `bf16+ckpt`, each in its own process
(so one mode's allocator state does not hide another's peak), train the same rows from the same weights: one
warm-up step, then `--repeats` timed steps of forward + backward over the rows in micro-batches, and an AdamW step.

Peak memory is the most the step holds above what was held before it (weights, AdamW state after the warm-up):
- CUDA: `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`, minus `memory_allocated()` before.
- CPU: the process's peak resident set (`VmHWM`, reset through `/proc/self/clear_refs` after `malloc_trim`), minus
  the resident set before. Coarser than the CUDA figure (the allocator may keep pages), but comparable across modes.

Prints a table with each mode's peak and median step time and their ratios to `fp32`.

Run: .venv/bin/python benchmarks/bench_precision.py [--device cpu|cuda] [--preset base-llama] [--rows 8]
     [--response-tokens 256] [--micro-batch 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from asyncflow.config import AlgoConfig
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.models.loading import load_model, resolve_model_path
from asyncflow.models.logprobs import TrainSample
from asyncflow.workers.trainer import PolicyLoss

MODES = {
    "fp32": dict(precision="fp32", activation_checkpointing=False),
    "fp32+ckpt": dict(precision="fp32", activation_checkpointing=True),
    "bf16": dict(precision="bf16", activation_checkpointing=False),
    "bf16+ckpt": dict(precision="bf16", activation_checkpointing=True),
}


def rows(n: int, response_tokens: int, vocab: int, group_size: int = 4) -> list[TrainSample]:
    rng = random.Random(0)
    samples = []
    for g in range(0, n, group_size):
        prompt = [rng.randrange(3, vocab) for _ in range(32)]
        for _ in range(min(group_size, n - g)):
            samples.append(TrainSample(prompt, [rng.randrange(3, vocab) for _ in range(response_tokens)], g))
    return samples


def loss_of(samples: list[TrainSample]) -> PolicyLoss:
    lengths = [len(s.response_ids) for s in samples]
    width = max(lengths)
    g = torch.Generator().manual_seed(0)
    return PolicyLoss(torch.randn(len(samples), width, generator=g), torch.full((len(samples), width), -2.0),
                      None, torch.ones(len(samples), width, dtype=torch.bool), lengths, AlgoConfig())


def step(engine: TorchTrainEngine, samples: list[TrainSample], micro_batch: int) -> float:
    loss = 0.0
    for start in range(0, len(samples), micro_batch):
        part = samples[start : start + micro_batch]
        loss += engine.backward_micro_batch(part, loss_of(part))["loss"]
    engine.optimizer_step(1.0 / sum(len(s.response_ids) for s in samples))
    return loss


class CPUPeak:
    """Peak resident set above the level at `reset` (Linux /proc)."""

    def reset(self) -> None:
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
        self.base = self._read("VmRSS")

    def peak(self) -> int:
        return self._read("VmHWM") - self.base

    @staticmethod
    def _read(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"{field} not in /proc/self/status")


class CUDAPeak:
    def reset(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated()

    def peak(self) -> int:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - self.base


def one_mode(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    path = resolve_model_path(f"preset:{args.preset}")
    model = load_model(path, device=args.device)
    engine = TorchTrainEngine(model, lr=1e-5, packing=args.packing, **MODES[args.one])
    samples = rows(args.rows, args.response_tokens, model.config.vocab_size)
    step(engine, samples, args.micro_batch)  # warm-up: AdamW state, kernels, allocator
    meter = CUDAPeak() if args.device.startswith("cuda") else CPUPeak()
    peaks, times, loss = [], [], 0.0
    for _ in range(args.repeats):
        meter.reset()
        t0 = time.perf_counter()
        loss = step(engine, samples, args.micro_batch)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peaks.append(meter.peak())
    params = sum(p.numel() for p in model.parameters())
    return {"mode": args.one, "peak_bytes": max(peaks), "step_s": statistics.median(times), "loss": loss,
            "params": params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="base-llama")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--response-tokens", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--packing", default="off", choices=["auto", "on", "off"])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--one", choices=list(MODES), help=argparse.SUPPRESS)  # a child process: one mode, JSON out
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_mode(args)))
        return
    results = {}
    for mode in args.modes.split(","):
        child = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("modes", "one")]
        proc = subprocess.run([sys.executable, __file__, *child, "--one", mode], capture_output=True, text=True,
                              timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"mode {mode} failed:\n{proc.stderr[-3000:]}")
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    first = next(iter(results.values()))
    print(f"device={args.device} preset={args.preset} ({first['params'] / 1e6:.1f}M params) rows={args.rows} "
          f"response_tokens={args.response_tokens} micro_batch={args.micro_batch} packing={args.packing} "
          f"repeats={args.repeats}")
    base = results.get("fp32", first)
    print(f"{'mode':<10} {'peak MB':>9} {'x fp32':>7} {'step s':>8} {'x fp32':>7} {'loss':>10}")
    for mode, r in results.items():
        print(f"{mode:<10} {r['peak_bytes'] / 2**20:9.1f} {r['peak_bytes'] / base['peak_bytes']:7.2f} "
              f"{r['step_s']:8.3f} {r['step_s'] / base['step_s']:7.2f} {r['loss']:10.4f}")


if __name__ == "__main__":
    main()
