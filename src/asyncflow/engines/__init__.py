"""Engines behind small interfaces; importing this package registers the built-in torch engines and `fsdp2`."""

from asyncflow.engines import fsdp2_train, torch_inference, torch_train  # noqa: F401  (registration)
from asyncflow.engines.base import (
    Completion,
    GenerationRequest,
    InferenceEngine,
    SamplingParams,
    TrainEngine,
    make_inference_engine,
    make_train_engine,
)

__all__ = [
    "Completion",
    "GenerationRequest",
    "InferenceEngine",
    "SamplingParams",
    "TrainEngine",
    "make_inference_engine",
    "make_train_engine",
]
