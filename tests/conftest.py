"""Shared fixtures: tiny preset models built once per session into a temporary cache."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    os.environ["ASYNCFLOW_CACHE"] = str(tmp_path_factory.mktemp("asyncflow-cache"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    yield


@pytest.fixture(scope="session")
def tiny_llama_path(_isolated_cache):
    from asyncflow.models.loading import resolve_model_path

    return resolve_model_path("preset:tiny-llama")


@pytest.fixture(scope="session")
def tiny_qwen2_path(_isolated_cache):
    from asyncflow.models.loading import resolve_model_path

    return resolve_model_path("preset:tiny-qwen2")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from threads; on a shared CPU oversubscribed OpenMP threads make them 10x slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
