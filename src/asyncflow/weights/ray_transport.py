"""The `ray` transport: weights through Ray's object store; the only weights module that imports `ray`.

Owns: `RayWeightPublisher` (`ray.put`s each bucket on a background thread, then records the refs in
a named `WeightStore` actor), `RayWeightReceiver` (asks the store for refs newer than its version
and `ray.get`s them), and the store actor itself.

Invariants:
- The store holds the refs of the newest version only, so older bucket objects are freed as soon
  as no receiver holds them; a version is recorded only after all its buckets are in the store.
- Objects are owned by the publishing process (`ray.put` there): they live as long as it does.
- Every remote call is bounded: a timeout raises `WeightSyncTimeout`, an unreachable store or lost
  object `WeightSyncError`.
"""

from __future__ import annotations

import pickle
import time
import uuid
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayError

from asyncflow.weights.background import BackgroundPublisher, BackgroundSender
from asyncflow.weights.base import PollingReceiver, Received, WeightSyncError, WeightSyncTimeout
from asyncflow.weights.buckets import DEFAULT_BUCKET_BYTES, Manifest, allocate_payload, bucket_views, unpack


# --------------------------------------------------------------------------- the store actor
class WeightStore:
    """The newest (version, manifest bytes, bucket refs); refs arrive nested so Ray keeps them as refs."""

    def __init__(self) -> None:
        self._latest: tuple[int, bytes, list[ray.ObjectRef[Any]]] | None = None
        self._full_requests = 0  # receivers' asks for a full version (`asyncflow.weights.delta`)

    def request_full(self) -> None:
        self._full_requests += 1

    def full_requests(self) -> int:
        return self._full_requests

    def put(self, version: int, manifest: bytes, refs: list[ray.ObjectRef[Any]]) -> None:
        if self._latest is None or version > self._latest[0]:
            self._latest = (version, manifest, refs)

    def newer_than(self, have_version: int) -> tuple[int, bytes, list[ray.ObjectRef[Any]]] | None:
        if self._latest is None or self._latest[0] <= have_version:
            return None
        return self._latest


WeightStoreActor = ray.remote(num_cpus=0)(WeightStore)  # the call form: typed as an ActorClass, unlike the decorator


def _get(refs: Any, timeout_s: float, what: str) -> Any:
    """`ray.get` whose failures say what was awaited: TimeoutError past `timeout_s`, ConnectionError otherwise."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError as err:
        raise TimeoutError(what) from err
    except RayError as err:
        raise ConnectionError(f"{what}: {err}") from err


# ------------------------------------------------------------------- publisher, receiver
@dataclass(frozen=True)
class RaySpec:
    store_name: str
    namespace: str | None
    timeout_s: float

    def open(self) -> RayWeightReceiver:
        return RayWeightReceiver(self)


class RayWeightPublisher(BackgroundPublisher):
    """Ray must be initialised."""

    transport = "ray"

    def __init__(
        self,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        *,
        store_name: str | None = None,
        namespace: str | None = None,
        timeout_s: float = 60.0,
        dtype: torch.dtype | None = None,
    ):
        self.timeout_s = timeout_s
        name = store_name or f"asyncflow-weight-store-{uuid.uuid4().hex[:12]}"
        # an actor handle: ray's types do not cover its methods' .remote
        self._store: Any = WeightStoreActor.options(name=name, namespace=namespace).remote()
        self.receiver_spec = RaySpec(name, namespace, timeout_s)
        self._sender = BackgroundSender(self.transport, self._send, bucket_bytes=bucket_bytes, dtype=dtype)

    def _send(self, version: int, manifest: Manifest, buckets: list[torch.Tensor]) -> None:
        try:
            refs = [ray.put(b.view(torch.uint8).numpy()) for b in buckets]
            recorded = self._store.put.remote(version, pickle.dumps(manifest), refs)
            _get(recorded, self.timeout_s, "the weight store to record a version")
        except TimeoutError as err:
            raise WeightSyncTimeout(
                self.transport, version, f"the weight store to record it ({err})", self.timeout_s
            ) from err
        except ConnectionError as err:
            raise WeightSyncError(f"ray: storing version {version} failed: {err}") from err

    def full_requests(self) -> int:
        try:
            return int(_get(self._store.full_requests.remote(), self.timeout_s, "the weight store's request count"))
        except TimeoutError as err:
            raise WeightSyncTimeout(self.transport, None, f"{err}", self.timeout_s) from err
        except ConnectionError as err:
            raise WeightSyncError(f"ray: weight store unreachable: {err}") from err

    def close(self) -> None:
        self._sender.close(self.timeout_s)
        ray.kill(self._store)


class RayWeightReceiver(PollingReceiver):
    transport = "ray"

    def __init__(self, spec: RaySpec):
        self._spec = spec
        deadline = time.monotonic() + spec.timeout_s
        while True:  # the store actor may not be registered yet
            try:
                self._store = ray.get_actor(spec.store_name, namespace=spec.namespace)
                break
            except ValueError:
                if time.monotonic() >= deadline:
                    raise WeightSyncTimeout(
                        self.transport, None, f"weight store {spec.store_name!r}", spec.timeout_s
                    ) from None
                time.sleep(0.05)

    def poll(self, have_version: int) -> Received | None:
        timeout_s = self._spec.timeout_s
        try:
            latest = _get(self._store.newer_than.remote(have_version), timeout_s, "the weight store's reply")
            if latest is None:
                return None
            version, manifest_bytes, refs = latest
            arrays = _get(refs, timeout_s, f"the {len(refs)} bucket objects of version {version}")
        except TimeoutError as err:
            waited_for = f"weights from the store ({err})"
            raise WeightSyncTimeout(self.transport, have_version + 1, waited_for, timeout_s) from err
        except ConnectionError as err:
            raise WeightSyncError(
                f"ray: weight store {self._spec.store_name!r} unreachable (publisher closed?): {err}"
            ) from err
        manifest: Manifest = pickle.loads(manifest_bytes)
        payload = allocate_payload(manifest)
        buckets = bucket_views(manifest, payload)
        for bucket, array in zip(buckets, arrays, strict=True):
            bucket.view(torch.uint8).numpy()[:] = array  # out of the read-only object-store mapping
        self.received_bytes = manifest.payload_bytes
        return version, unpack(manifest, buckets)

    def request_full(self) -> None:
        """Ask the publisher for a full version: a call the store takes in order, not waited for."""
        self._store.request_full.remote()

    def close(self) -> None:
        """Holds no objects between polls."""
