"""`make_runtime`: the runtime of `runtime.kind` (`auto`: inline for `sync` and for an agent's rollouts, Ray
for the separated workflows), and `rank_launcher`: where that runtime places a multi-rank trainer's ranks. The
Ray runtime is imported only when asked for, so `ray` stays unimported otherwise."""

from __future__ import annotations

import importlib.util

from asyncflow.config import Config, ConfigError
from asyncflow.runtime.base import RolloutSpec, Runtime
from asyncflow.workers.reward import RewardWorker


def runtime_kind(config: Config) -> str:
    """`inline` or `ray`: `runtime.kind`, with `auto` resolved by the workflow mode."""
    kind = config.runtime.kind
    if kind == "auto":
        kind = "inline" if config.workflow.mode == "sync" or config.agent_rollouts else "ray"
    return kind


def require_ray(config: Config) -> None:
    """A clear error when the config places work on Ray and the `ray` extra is not installed."""
    try:
        found = importlib.util.find_spec("ray") is not None
    except ValueError:  # sys.modules["ray"] is None: taken away on purpose
        found = False
    if not found:
        why = "runtime.kind=ray" if config.runtime.kind == "ray" else \
            f"workflow.mode={config.workflow.mode} with runtime.kind=auto runs rollout replicas on Ray"
        raise ConfigError(f"{why}, and ray is not installed: pip install 'asyncflow-rl[ray]', or set "
                          "runtime.kind=inline")


def runtime_class(config: Config) -> type[Runtime]:
    """The runtime of `runtime_kind(config)`, its module imported (Ray's only here, and only for `ray`)."""
    if runtime_kind(config) == "ray":
        require_ray(config)
        from asyncflow.runtime.ray_runtime import RayRuntime

        return RayRuntime
    from asyncflow.runtime.inline import InlineRuntime

    return InlineRuntime


def make_runtime(config: Config, spec: RolloutSpec, scorer: RewardWorker) -> Runtime:
    """The runtime placing the rollout replicas of `spec`; `scorer` is the driver's reward worker (inline)."""
    if runtime_kind(config) == "ray" and config.workflow.mode == "sync":
        raise ConfigError("workflow.mode=sync generates, scores and trains one after another in this process: "
                          "use runtime.kind=inline (or auto), or workflow.mode=stream|async for Ray replicas")
    return runtime_class(config)(config, spec, scorer)


def rank_launcher(config: Config):
    """The `Launcher` (`asyncflow.engines.fsdp2_train`) of a multi-rank training engine's ranks: the runtime's
    (`Runtime.rank_launcher`), so they run where the runtime places work."""
    return runtime_class(config).rank_launcher(config)
