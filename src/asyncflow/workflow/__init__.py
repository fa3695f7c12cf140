"""Workflows decide when weights move and how far rollout may run ahead of training."""

from asyncflow.config import Config


def make_workflow(config: Config):
    mode = config.workflow.mode
    if mode == "sync":
        from asyncflow.workflow.sync import SyncWorkflow

        return SyncWorkflow()
    raise ValueError(f"workflow.mode={mode!r} is not available in this build")
