"""Ray object-store adapter for weight sync: the only weight-sync code that imports `ray`.

Owns: the named weight-store actor and the four calls the `ray` transport of
`asyncflow.workflow.weight_sync` makes on it. It moves opaque values (a version, manifest bytes,
bucket arrays) and knows nothing about state dicts.

Invariants:
- The store holds the refs of the newest version only, so older bucket objects are freed as soon
  as no receiver holds them; a version is recorded only after all its buckets are in the store.
- Objects are owned by the publishing process (`ray.put` there): they live as long as it does.
- Every remote call is bounded: a timeout raises the builtin `TimeoutError`, an unreachable store
  or lost object raises `ConnectionError` (the caller turns them into weight-sync errors).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayError


@ray.remote(num_cpus=0)
class WeightStore:
    """The newest (version, manifest bytes, bucket refs); refs arrive nested so Ray keeps them as refs."""

    def __init__(self) -> None:
        self._latest: tuple[int, bytes, list[ray.ObjectRef]] | None = None

    def put(self, version: int, manifest: bytes, refs: list[ray.ObjectRef]) -> None:
        if self._latest is None or version > self._latest[0]:
            self._latest = (version, manifest, refs)

    def newer_than(self, have_version: int) -> tuple[int, bytes, list[ray.ObjectRef]] | None:
        if self._latest is None or self._latest[0] <= have_version:
            return None
        return self._latest


def _get(refs: Any, timeout_s: float, what: str) -> Any:
    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError as err:
        raise TimeoutError(what) from err
    except RayError as err:
        raise ConnectionError(f"{what}: {err}") from err


def create_weight_store(name: str, namespace: str | None) -> Any:
    return WeightStore.options(name=name, namespace=namespace).remote()


def find_weight_store(name: str, namespace: str | None, timeout_s: float) -> Any:
    """The store actor by name, retrying until it is registered or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get_actor(name, namespace=namespace)
        except ValueError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"weight store {name!r} to be registered") from None
            time.sleep(0.05)


def store_version(store: Any, version: int, manifest: bytes, buckets: list[np.ndarray], timeout_s: float) -> None:
    refs = [ray.put(bucket) for bucket in buckets]
    _get(store.put.remote(version, manifest, refs), timeout_s, "the weight store to record a version")


def fetch_newer(store: Any, have_version: int, timeout_s: float) -> tuple[int, bytes, list[np.ndarray]] | None:
    """(version, manifest, read-only bucket arrays) of the stored version if newer than `have_version`."""
    latest = _get(store.newer_than.remote(have_version), timeout_s, "the weight store's reply")
    if latest is None:
        return None
    version, manifest, refs = latest
    return version, manifest, _get(refs, timeout_s, f"the {len(refs)} bucket objects of version {version}")


def kill_weight_store(store: Any) -> None:
    ray.kill(store)
