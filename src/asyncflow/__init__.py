"""asyncflow: asynchronous, streaming RL post-training for language models.

The public interface (see docs/python-api.md); names load on first use, so `import asyncflow` stays light:

    import asyncflow
    config = asyncflow.load_config("examples/arithmetic_grpo.yaml", ["train.steps=20"])
    result = asyncflow.train(config, overwrite=True)

Layers (imports point down only): cli -> api -> workflow -> runtime -> workers -> serving -> engines ->
weights/algos/rewards/models/data/transfer/observe/envs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_PUBLIC = {
    "Config": "asyncflow.config",
    "ConfigError": "asyncflow.config",
    "load_config": "asyncflow.config",
    "build_config": "asyncflow.config",
    "train": "asyncflow.api",
    "sft": "asyncflow.api",
    "evaluate": "asyncflow.api",
    "export": "asyncflow.api",
    "serve": "asyncflow.api",
    "TrainResult": "asyncflow.api",
    "open_run": "asyncflow.api",
    "RunStopped": "asyncflow.workflow.stopping",
}
__all__ = ["__version__", *_PUBLIC]

if TYPE_CHECKING:
    from asyncflow.api import TrainResult, evaluate, export, open_run, serve, sft, train  # noqa: F401
    from asyncflow.config import Config, ConfigError, build_config, load_config  # noqa: F401
    from asyncflow.workflow.stopping import RunStopped  # noqa: F401


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'asyncflow' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
