"""The environment interface of multi-turn rollouts, and the environment registry.

Owns: `Environment` (what a rollout asks of an environment), `StepResult`, `ENVIRONMENTS` with
`register_environment(name)`, and `make_environment(spec, **options)`, which takes a registered name or a
user environment as `package.module:factory`.

An episode: `reset(row)` once (the row's metadata: `answer`, `sample_index` and the task's fields), then,
per model turn, `step(model_text)` with the text the model wrote in that turn. `step` returns an
observation to show the model next (a tool's output, or an error message for a malformed call) and
`done=False`, or `done=True` with the episode's `reward`.

Invariants:
- An environment instance serves one episode at a time; the rollout makes one per episode.
- `step` never raises for anything the model wrote: a malformed call is an observation. An exception from
  `step` is a bug of the environment and fails the episode's row loudly.
- A registered name resolves to one factory; `make_environment` either returns an environment or raises
  `EnvironmentSpecError` naming the spec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from asyncflow.specs import import_callable


class EnvironmentSpecError(ValueError):
    """An environment spec that does not resolve (unknown name, module or attribute missing)."""


@dataclass
class StepResult:
    observation: str | None = None
    """Text to show the model before its next turn (`done=False`); ignored when done."""
    reward: float = 0.0
    """The episode's reward (read when `done`)."""
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    """Counters for metrics, summed over the episode: `tool_calls`, `tool_errors`, `tool_timeouts`,
    `malformed_calls`."""


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: dict[str, Any]) -> None:
        """Start an episode for a data row (its metadata: `answer` and the task's fields). The first prompt is
        the row's prompt, already rendered (chat template included) by the data plane."""
        ...

    def step(self, model_text: str) -> StepResult:
        """The model wrote `model_text` (one turn, special tokens removed): observe, or finish with a reward."""
        ...

    # Optional: `demonstration(row) -> list[str] | None`, the model turns of a solved episode (SFT warm-up).


EnvFactory = Callable[..., Environment]
ENVIRONMENTS: dict[str, EnvFactory] = {}


def register_environment(name: str) -> Callable[[EnvFactory], EnvFactory]:
    """Decorator: register an environment factory under `name`."""
    if not name or ":" in name:
        raise ValueError(f"environment name must be non-empty without ':', got {name!r}")

    def decorate(factory: EnvFactory) -> EnvFactory:
        if name in ENVIRONMENTS and ENVIRONMENTS[name] is not factory:
            raise ValueError(f"environment name {name!r} is already registered to {ENVIRONMENTS[name]!r}")
        ENVIRONMENTS[name] = factory
        return factory

    return decorate


def resolve_environment(spec: str) -> EnvFactory:
    """A registered name or `package.module:factory` -> the factory (raises `EnvironmentSpecError`)."""
    if ":" not in spec:
        if spec not in ENVIRONMENTS:
            raise EnvironmentSpecError(
                f"env.name {spec!r} is not a registered environment ({sorted(ENVIRONMENTS)}); "
                "or give 'package.module:factory'"
            )
        return ENVIRONMENTS[spec]
    return import_callable(spec, label="env.name", error=EnvironmentSpecError)


def make_environment(spec: str, **options: Any) -> Environment:
    """One fresh environment (one episode) from a spec; `options` go to the factory."""
    return resolve_environment(spec)(**options)
