"""Workflows decide when weights move and how far rollout may run ahead of training."""

from asyncflow.config import Config


def make_runtime(config: Config):
    """The runtime of `runtime.kind` (`auto`: inline for `sync`, Ray for the separated workflows)."""
    kind = config.runtime.kind
    if kind == "auto":
        kind = "inline" if config.workflow.mode == "sync" else "ray"
    if kind == "ray":
        from asyncflow.runtime.ray_runtime import RayRuntime

        return RayRuntime(config)
    from asyncflow.runtime.inline import InlineRuntime

    return InlineRuntime(config)


def make_workflow(config: Config, run):
    """The workflow of `config.workflow.mode` (sync, stream or async) over the configured runtime."""
    from asyncflow.workflow.pipeline import PipelineWorkflow

    return PipelineWorkflow(run, make_runtime(config))
