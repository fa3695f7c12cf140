"""The reward-function contract, checked: what a reward function must look like and may return.

Owns: `check_reward_fn` (signature check, before any call), `reward_value` (is a returned value a
reward?), `call_reward` (one guarded call: a value or a `Failure`, never an exception), `Failure`,
`RewardFailure`, `RewardSpecError` and `reward_name`.

The contract: `fn(completion: str, ground_truth: str, **metadata) -> float`.
Invariants:
- A reward is a finite real number: `float`, `int`, `bool` (exactly 0 or 1: `return answer == truth`
  is a reward), `fractions.Fraction`, numpy numbers and numpy bools. Everything else is not a reward,
  even when `float()` would take it: `None`, `"1.0"`, a list, a tensor, NaN and +-inf.
- `check_reward_fn` rejects what can be told from the signature alone: a function that cannot be
  called with two positional arguments, or that does not take `**metadata` (every row's other
  fields, e.g. `answer`, `sample_index`, `finish_reason`, are passed as keyword arguments). A callable
  whose signature Python cannot read (some builtins) is accepted.
- `call_reward` never raises (not even for KeyboardInterrupt/SystemExit raised by the function; those
  are failures of the sample) and returns picklable results, so a worker process can send them.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

RewardFn = Callable[..., float]


class RewardSpecError(ValueError):
    """A reward spec (registered name or "package.module:function") cannot be resolved, or what it names
    cannot be a reward function."""


class Failure(NamedTuple):
    """Why one sample has no reward. `kind` groups failures for logging: "error:<ExceptionType>",
    "value" (not a finite number), "timeout" or "died" (its worker process ended)."""

    fn_name: str
    kind: str
    detail: str


class RewardFailure(Exception):
    """Raised by a composite reward when one of its components fails; carries that component's `Failure`."""

    def __init__(self, failure: Failure):
        super().__init__(f"reward function {failure.fn_name!r}: {failure.detail}")
        self.failure = failure


def reward_name(spec: Any) -> str:
    """A short name for logs: the spec string itself, a callable object's own `reward_name` (e.g. a judge's),
    or `module:qualname` of a function."""
    if isinstance(spec, str):
        return spec.strip()
    if isinstance(getattr(spec, "reward_name", None), str):
        return spec.reward_name
    module, qualname = getattr(spec, "__module__", None), getattr(spec, "__qualname__", None)
    if module and qualname:
        return f"{module}:{qualname}"
    return repr(spec)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def reward_value(value: Any) -> float | None:
    """`value` as a float if it is a reward (a finite real number, see the module invariants), else None."""
    kind = type(value)
    if kind is float:
        return value if math.isfinite(value) else None
    is_number = kind is int or kind is bool or isinstance(value, numbers.Real)
    if not (is_number or (kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool"))):
        return None
    try:
        number = float(value)
    except (OverflowError, TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def value_failure(fn_name: str, value: Any) -> Failure:
    return Failure(fn_name, "value", f"returned {_short(value)} ({type(value).__name__}), which is not a reward: "
                   "a reward is a finite float, int or bool")


def error_failure(fn_name: str, error: BaseException) -> Failure:
    return Failure(fn_name, f"error:{type(error).__name__}", f"raised {type(error).__name__}: {error}")


def call_reward(fn: RewardFn, fn_name: str, completion: str, ground_truth: str,
                metadata: dict | None) -> tuple[float, Failure | None]:
    """(reward, None), or (0.0, failure) when `fn` raises or returns something that is not a reward."""
    try:
        value = fn(completion, ground_truth, **metadata) if metadata else fn(completion, ground_truth)
    except RewardFailure as failed:  # a component of a composite reward failed
        return 0.0, failed.failure
    except BaseException as error:  # noqa: BLE001 - any failure of user code is a failed sample
        return 0.0, error_failure(fn_name, error)
    if type(value) is float and value - value == 0.0:  # the common case, cheaply: finite float
        return value, None
    number = reward_value(value)
    if number is None:
        return 0.0, value_failure(fn_name, value)
    return number, None


def check_reward_fn(fn: Any, spec: Any = None) -> None:
    """Raise `RewardSpecError` naming `spec` if `fn` cannot be a reward function (see the module invariants)."""
    label = reward_name(spec if spec is not None else fn)
    if not callable(fn):
        raise RewardSpecError(f"reward {label!r} is a {type(fn).__name__}, not callable")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or extension callable without a readable signature
        return
    try:
        signature.bind("completion", "ground_truth")
    except TypeError as err:
        raise RewardSpecError(
            f"reward {label!r} has the signature {signature}, which cannot be called as "
            f"fn(completion, ground_truth, **metadata): {err}"
        ) from None
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        raise RewardSpecError(
            f"reward {label!r} has the signature {signature} without **metadata: every row's other fields "
            "(answer, sample_index, finish_reason, dataset columns) are passed as keyword arguments; "
            "add **metadata to its parameters"
        )
