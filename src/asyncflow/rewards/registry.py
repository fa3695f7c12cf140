"""Reward function registry: names -> reward functions, "module:function" specs, weighted sums.

Owns: `REWARDS` (name -> fn), `register_reward(name)`, `resolve_reward(spec)`, `check_reward_specs`
(the whole reward section checked before any model is loaded) and `CompositeReward`. A reward function
has the signature `fn(completion: str, ground_truth: str, **metadata) -> float` (`contract.py`).
Invariants:
- A name is registered once; registering a different function under a taken name raises.
- `resolve_reward` either returns a callable or raises `RewardSpecError` (a ValueError) naming
  the spec and what is wrong with it (unknown name, module not importable, attribute missing,
  not callable). It never returns None.
- `check_reward_specs` calls no reward function: it imports, resolves and checks signatures (and,
  for process isolation, that each function can be sent to another process).
- `CompositeReward` checks each component's value like the runner does (`contract.reward_value`) and
  raises `RewardFailure` naming the component that raised or returned a non-number.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Sequence

from asyncflow.rewards import verifiers
from asyncflow.rewards.contract import (
    RewardFailure,
    RewardFn,
    RewardSpecError,
    check_reward_fn,
    error_failure,
    reward_name,
    reward_value,
    value_failure,
)
from asyncflow.specs import import_callable

REWARDS: dict[str, RewardFn] = {}


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
    return import_callable(spec, label="reward spec", error=RewardSpecError)


def display_name(spec: str | RewardFn) -> str:
    """The name a reward is logged under: its spec string, its registered name, or `module:qualname`."""
    if not isinstance(spec, str):
        for name, fn in REWARDS.items():
            if fn is spec:
                return name
    return reward_name(spec)


def check_reward_specs(
    specs: Sequence[str | RewardFn], weights: Sequence[float] | None = None, *, isolation: str = "thread"
) -> list[tuple[RewardFn, float]]:
    """Resolve and check every reward spec without calling any: importable, callable as
    `fn(completion, ground_truth, **metadata)`, finite weights (as many as specs), and with
    `isolation="process"` picklable (a module-level function). Returns [(fn, weight), ...];
    raises `RewardSpecError` naming the first bad spec."""
    specs = list(specs)
    if not specs:
        raise RewardSpecError("no reward function given (reward.fns is empty)")
    weights = [1.0] * len(specs) if weights is None else list(weights)
    if len(weights) != len(specs):
        raise RewardSpecError(f"{len(weights)} reward weights for {len(specs)} reward functions")
    if isolation not in ("thread", "process"):
        raise RewardSpecError(f"reward isolation must be 'thread' or 'process', got {isolation!r}")
    pairs = []
    for spec, weight in zip(specs, weights):
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise RewardSpecError(f"reward {display_name(spec)!r}: weight must be a finite number, got {weight!r}")
        fn = resolve_reward(spec)
        check_reward_fn(fn, spec)
        if isolation == "process":
            check_picklable(fn, spec)
        pairs.append((fn, float(weight)))
    return pairs


def check_picklable(fn: RewardFn, spec: str | RewardFn | None = None) -> None:
    """Raise `RewardSpecError` if `fn` cannot be sent to a reward worker process."""
    try:
        pickle.dumps(fn)
    except Exception as err:  # noqa: BLE001 - PicklingError, AttributeError (local objects), TypeError, ...
        raise RewardSpecError(
            f"reward {reward_name(spec if spec is not None else fn)!r} cannot be sent to a worker process "
            f"(reward.isolation: process needs a module-level function or a picklable object): {err}"
        ) from None


class CompositeReward:
    """Weighted sum of reward functions: sum_k weight_k * fn_k(completion, ground_truth, **metadata).

    components: [(fn or spec, weight), ...], non-empty, finite weights. If any component raises or
    returns something that is not a reward, the composite raises `RewardFailure` naming that component
    (the runner then scores the sample 0.0 and counts an error).
    """

    def __init__(self, components: Sequence[tuple[str | RewardFn, float]]):
        if not components:
            raise ValueError("CompositeReward needs at least one (fn, weight) component")
        self.components: list[tuple[RewardFn, float]] = []
        self.names: list[str] = []
        for item in components:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise ValueError(f"CompositeReward components are (fn, weight) pairs, got {item!r}")
            fn, weight = item
            if not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(f"CompositeReward weight must be a finite number, got {weight!r}")
            self.components.append((resolve_reward(fn), float(weight)))
            self.names.append(display_name(fn))

    def __call__(self, completion: str, ground_truth: str, **metadata) -> float:
        total = 0.0
        for (fn, weight), name in zip(self.components, self.names):
            try:
                value = fn(completion, ground_truth, **metadata)
            except RewardFailure:
                raise
            except Exception as error:
                raise RewardFailure(error_failure(name, error)) from error
            number = reward_value(value)
            if number is None:
                raise RewardFailure(value_failure(name, value))
            total += weight * number
        return total

    def __repr__(self) -> str:
        parts = ", ".join(f"({getattr(fn, '__name__', fn)!s}, {w})" for fn, w in self.components)
        return f"CompositeReward([{parts}])"
