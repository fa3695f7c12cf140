"""Reward function registry: names -> reward functions, "module:function" specs, weighted sums.

Owns: `REWARDS` (name -> fn), `register_reward(name)`, `resolve_reward(spec)` and
`CompositeReward`. A reward function has the signature
`fn(completion: str, ground_truth: str, **metadata) -> float`.
Invariants:
- A name is registered once; registering a different function under a taken name raises.
- `resolve_reward` either returns a callable or raises `RewardSpecError` (a ValueError) naming
  the spec and what is wrong with it (unknown name, module not importable, attribute missing,
  not callable). It never returns None.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence

from asyncflow.rewards import verifiers

RewardFn = Callable[..., float]

REWARDS: dict[str, RewardFn] = {}


class RewardSpecError(ValueError):
    """A reward spec (registered name or "package.module:function") cannot be resolved."""


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register `fn` under `name` in REWARDS (returns fn unchanged)."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"reward name must be a non-empty string without ':', got {name!r}")

    def decorate(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise ValueError(f"cannot register reward {name!r}: {fn!r} is not callable")
        if name in REWARDS and REWARDS[name] is not fn:
            raise ValueError(f"reward name {name!r} is already registered to {REWARDS[name]!r}")
        REWARDS[name] = fn
        return fn

    return decorate


for _name in ("exact_match", "numeric_match", "math_verify", "format_reward", "answer_tag_match"):
    register_reward(_name)(getattr(verifiers, _name))


def resolve_reward(spec: str | RewardFn) -> RewardFn:
    """A registered name (e.g. "math_verify"), a "package.module:function" spec (the attribute
    may be dotted, "module:Class.method"), or a callable (returned as is) -> reward function."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise RewardSpecError(f"reward spec must be a non-empty string or a callable, got {spec!r}")
    spec = spec.strip()
    if ":" not in spec:
        if spec in REWARDS:
            return REWARDS[spec]
        raise RewardSpecError(
            f"unknown reward {spec!r}; registered: {sorted(REWARDS)}; or use 'package.module:function'"
        )
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise RewardSpecError(f"reward spec {spec!r} must look like 'package.module:function'")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # ModuleNotFoundError, or any error raised while importing it
        raise RewardSpecError(f"reward spec {spec!r}: cannot import module {module_name!r}: {e!r}") from e
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise RewardSpecError(f"reward spec {spec!r}: {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardSpecError(f"reward spec {spec!r}: {attr_path!r} is a {type(obj).__name__}, not callable")
    return obj


class CompositeReward:
    """Weighted sum of reward functions: sum_k weight_k * fn_k(completion, ground_truth, **metadata).

    components: [(fn or spec, weight), ...], non-empty, finite weights. If any component raises,
    the composite raises (the runner then scores the sample 0.0 and counts an error).
    """

    def __init__(self, components: Sequence[tuple[str | RewardFn, float]]):
        if not components:
            raise ValueError("CompositeReward needs at least one (fn, weight) component")
        self.components: list[tuple[RewardFn, float]] = []
        for item in components:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise ValueError(f"CompositeReward components are (fn, weight) pairs, got {item!r}")
            fn, weight = item
            if not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(f"CompositeReward weight must be a finite number, got {weight!r}")
            self.components.append((resolve_reward(fn), float(weight)))

    def __call__(self, completion: str, ground_truth: str, **metadata) -> float:
        return sum(w * float(fn(completion, ground_truth, **metadata)) for fn, w in self.components)

    def __repr__(self) -> str:
        parts = ", ".join(f"({getattr(fn, '__name__', fn)!s}, {w})" for fn, w in self.components)
        return f"CompositeReward([{parts}])"
