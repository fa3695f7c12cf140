"""`make_runtime`: the runtime of `runtime.kind` (`auto`: inline for `sync` and for an agent's rollouts, Ray
for the separated workflows). The Ray runtime is imported only when asked for, so `ray` stays unimported
otherwise."""

from __future__ import annotations

from asyncflow.config import Config


def runtime_kind(config: Config) -> str:
    """`inline` or `ray`: `runtime.kind`, with `auto` resolved by the workflow mode."""
    kind = config.runtime.kind
    if kind == "auto":
        kind = "inline" if config.workflow.mode == "sync" or config.agent.fn is not None else "ray"
    return kind


def make_runtime(config: Config):
    kind = runtime_kind(config)
    if kind == "ray":
        from asyncflow.runtime.ray_runtime import RayRuntime

        return RayRuntime(config)
    from asyncflow.runtime.inline import InlineRuntime

    return InlineRuntime(config)
