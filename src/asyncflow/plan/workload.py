"""Workloads for the simulator: prompt and response length distributions, and the algorithm's batch shape.

Owns: `Lengths` (a length distribution: fixed, uniform, geometric, lognormal (a long tail, as reasoning traces
have) or an empirical sample), `Workload` (prompts per step, group size, both distributions) and
`Workload.sample` (the `[steps, rows]` length arrays `asyncflow.plan.sim` runs on). `lengths_from_run` reads a
run's `metrics.jsonl` (mean and max response length per step) into a geometric-with-cap distribution.

Invariants: sampled lengths are integers in `[1, max]`; the same seed gives the same arrays.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field


class Lengths(BaseModel):
    """A token-length distribution, truncated to `[1, max]`."""

    kind: Literal["fixed", "uniform", "geometric", "lognormal", "empirical"] = "fixed"
    mean: float = Field(64.0, gt=0)
    """fixed: the length; geometric / lognormal: the mean before truncation; uniform: the middle."""
    max: int = Field(4096, ge=1)
    sigma: float = 1.0
    """lognormal: the sigma of log length (1.0 gives a long tail: p99 ~ 10x the median)."""
    spread: float = 0.5
    """uniform: the half-width as a fraction of `mean`."""
    values: list[int] = []
    """empirical: lengths to draw from."""

    def sample(self, shape: int | tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        out: np.ndarray
        if self.kind == "fixed":
            out = np.full(shape, self.mean)
        elif self.kind == "uniform":
            out = rng.uniform(self.mean * (1 - self.spread), self.mean * (1 + self.spread), shape)
        elif self.kind == "geometric":
            out = rng.geometric(1.0 / max(self.mean, 1.0), shape)
        elif self.kind == "lognormal":
            mu = np.log(self.mean) - self.sigma**2 / 2
            out = np.exp(rng.standard_normal(shape, dtype=np.float32) * np.float32(self.sigma) + np.float32(mu))
        else:
            out = rng.choice(np.asarray(self.values), shape)
        return np.clip(np.rint(out), 1, self.max).astype(np.int32)

    @classmethod
    def truncated_geometric(cls, mean: float, max: int) -> Lengths:
        """The geometric lengths whose mean *after* truncation to `[1, max]` is `mean` (what a run measures:
        `E[min(X, max)] = (1 - (1 - p)^max) / p` for X ~ Geometric(p), solved for p); fixed at `max` when
        `mean` is within 0.1% of it."""
        if mean >= max * 0.999:
            return cls(kind="fixed", mean=max, max=max)
        lo, hi = 1e-9, 1.0  # the truncated mean falls from ~max to 1 as p rises
        for _ in range(100):
            p = (lo + hi) / 2
            lo, hi = (p, hi) if (1 - (1 - p) ** max) / p > mean else (lo, p)
        return cls(kind="geometric", mean=1.0 / hi, max=max)


class Workload(BaseModel):
    """The rows of each step: `prompts_per_step` prompts, each sampled `group_size` times."""

    prompts_per_step: int = Field(32, ge=1)
    group_size: int = Field(8, ge=1)
    prompt: Lengths = Lengths(kind="fixed", mean=8)
    response: Lengths = Lengths(kind="geometric", mean=16, max=64)

    @property
    def rows(self) -> int:
        return self.prompts_per_step * self.group_size

    def sample(self, steps: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """`[steps, rows]` prompt lengths (one per group, repeated over its rows) and response lengths."""
        rng = np.random.default_rng(seed)
        prompts = np.repeat(self.prompt.sample((steps, self.prompts_per_step), rng), self.group_size, axis=1)
        return prompts, self.response.sample((steps, self.rows), rng)


def lengths_from_run(run_dir: str | Path) -> Lengths:
    """Geometric lengths truncated at a run's largest response with the run's mean response length
    (`metrics.jsonl`)."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    means = [r["response_length/mean"] for r in rows if "response_length/mean" in r]
    maxes = [r["response_length/max"] for r in rows if "response_length/max" in r]
    if not means:
        raise ValueError(f"{run_dir}/metrics.jsonl has no response_length/mean")
    return Lengths.truncated_geometric(float(np.mean(means)), int(max(maxes)))
