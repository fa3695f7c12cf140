"""Engines behind small interfaces; importing this package registers the built-in torch engines, `fsdp2` and the
vLLM adapter (which imports vLLM only when an engine is made)."""

from asyncflow.engines import fsdp2_train, torch_inference, torch_train, vllm_engine  # noqa: F401  (registration)
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
