"""One long-running generation loop over an inference engine, fed by many threads.

Owns: `EngineService`, which runs `engine.generate` in a background thread over a request source
that never blocks the batch, and hands each caller a `Future[Completion]`. It is what lets an HTTP
server, or many multi-turn episodes each waiting on a tool, share one engine with continuous
batching: a new request joins the running batch as soon as the engine has a free slot.

Invariants:
- Each `submit` resolves exactly once: with its `Completion`, or with the error that stopped the loop
  (later submits then raise `EngineServiceError` at once). With `restart_on_error=True` (a server) an engine
  error fails only the request that causes it: the requests in flight at that moment run again one at a
  time, and those that fail alone fail (as does one that already streamed tokens: it cannot be replayed);
  the loop then starts a fresh `generate` and later submits are served (`engine_failures` and `last_error`
  say what happened; `healthy` stays true).
- `update_weights` lets every in-flight request finish on the old weights ("finish" semantics), swaps
  the weights while no `generate` is open, then resumes; requests submitted meanwhile wait, and every
  completion's `weight_version` is the version that generated it.
- While nothing is in flight the source blocks on its inbox (no busy polling); while requests are in
  flight it yields `None` when it has nothing new, so the engine keeps decoding.
- A caller's `on_tokens` gets every response token once, in order, before its future resolves: as sampled
  when the engine `streams_tokens`, else all at once when the completion arrives. It runs on the loop's
  thread; one that raises is logged and dropped, never stopping the loop.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future

import torch

from asyncflow.engines.base import Completion, GenerationRequest, InferenceEngine, SamplingParams, TokenCallback

log = logging.getLogger(__name__)
_IDLE_CHECK_S = 0.1  # how often an idle loop looks for close() / a weight update


class EngineServiceError(RuntimeError):
    """The generation loop stopped (closed, or the engine raised)."""


class EngineService:
    def __init__(self, engine: InferenceEngine, params: SamplingParams, *, name: str = "engine-service",
                 restart_on_error: bool = False) -> None:
        self.engine = engine
        self.params = params
        self.restart_on_error = restart_on_error
        self.engine_failures = 0  # engine errors survived (restart_on_error)
        self.last_error: str | None = None
        self._inbox: queue.SimpleQueue[tuple[GenerationRequest, Future[Completion]]] = queue.SimpleQueue()
        self._pending: dict[int, Future[Completion]] = {}  # in the engine, by internal request id
        self._in_flight: dict[int, GenerationRequest] = {}  # the same requests (replayed alone after an error)
        self._streamed: set[int] = set()  # requests whose caller has seen tokens
        self._deliver_at_end: dict[int, TokenCallback] = {}  # on_tokens of requests to an engine that cannot stream
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._update: tuple[Mapping[str, torch.Tensor], int, Future[None]] | None = None
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers
    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None, *,
               on_tokens: TokenCallback | None = None, session: str | None = None) -> Future[Completion]:
        """Queue one generation; the future resolves to its `Completion` (whose `request_id` is internal).
        `on_tokens(token_ids, logprobs)` receives its tokens before that (see the module docstring). `session`:
        which episode or user the request belongs to, for a router over several services; one service ignores it."""
        callback = _guarded(on_tokens) if on_tokens is not None else None
        with self._lock:
            if self._closed or self._error is not None:
                raise EngineServiceError(f"the engine service is stopped: {self._error or 'closed'}")
            future: Future[Completion] = Future()
            self._inbox.put((GenerationRequest(next(self._ids), list(prompt_ids), params, callback), future))
        return future

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None, *, timeout: float) -> Completion:
        """`submit` and wait (at most `timeout` seconds)."""
        return self.submit(prompt_ids, params).result(timeout=timeout)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, *, timeout: float) -> None:
        """Load new weights once the requests in flight have finished; blocks until loaded."""
        done: Future[None] = Future()
        with self._lock:
            if self._update is not None:
                raise RuntimeError("a weight update is already waiting")
            self._update = (state_dict, version, done)
        done.result(timeout=timeout)

    @property
    def healthy(self) -> bool:
        """Whether a `submit` now would be served (the loop runs and is not closed)."""
        return self._thread.is_alive() and not self._closed and self._error is None

    @property
    def streams_tokens(self) -> bool:
        """Whether `on_tokens` sees tokens as they are sampled (else all of them when the completion is done)."""
        return self.engine.streams_tokens

    def close(self, timeout: float = 30.0) -> None:
        """Stop taking requests, let the ones in flight finish, stop the loop."""
        with self._lock:
            self._closed = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"engine service did not stop within {timeout} s")

    def __enter__(self) -> EngineService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        try:
            while not self._stopping():
                try:
                    for completion in self.engine.generate(self._requests(), self.params):
                        on_tokens = self._deliver_at_end.pop(completion.request_id, None)
                        if on_tokens is not None:
                            on_tokens(list(completion.response_ids), list(completion.logprobs))
                        self._in_flight.pop(completion.request_id, None)
                        self._streamed.discard(completion.request_id)
                        self._pending.pop(completion.request_id).set_result(completion)
                except Exception as error:
                    if not self.restart_on_error or not self._pending:  # no request to blame: the engine is broken
                        raise
                    self._isolate_failure(error)
                self._apply_update()
        except BaseException as error:  # noqa: BLE001 -- every waiting caller must learn why
            with self._lock:
                self._error = error
            for future in [*self._pending.values(), *self._drain_inbox()]:
                future.set_exception(EngineServiceError(f"generation loop failed: {error!r}"))
            if self._update is not None:
                self._update[2].set_exception(EngineServiceError(f"generation loop failed: {error!r}"))
        else:
            for future in self._drain_inbox():
                future.set_exception(EngineServiceError("the engine service was closed"))

    def _isolate_failure(self, error: Exception) -> None:
        """An engine error with `restart_on_error`: run each request that was in flight again alone, so that only
        the ones the engine fails on alone fail; keep the loop."""
        self.engine_failures += 1
        self.last_error = f"{type(error).__name__}: {error}"
        log.error("the engine failed with %d request(s) in flight; each runs again alone", len(self._pending),
                  exc_info=error)
        pending, requests, streamed = self._pending, self._in_flight, self._streamed
        self._pending, self._in_flight, self._streamed = {}, {}, set()
        for request_id, future in pending.items():
            on_tokens = self._deliver_at_end.pop(request_id, None)
            if len(pending) == 1 or request_id in streamed:
                future.set_exception(EngineServiceError(f"the engine failed on this request: {error!r}"))
                continue
            try:
                (completion,) = self.engine.generate(iter([requests[request_id]]), self.params)
            except Exception as alone:  # noqa: BLE001 - this request is the one the engine fails on
                future.set_exception(EngineServiceError(f"the engine failed on this request: {alone!r}"))
                continue
            if on_tokens is not None:
                on_tokens(list(completion.response_ids), list(completion.logprobs))
            future.set_result(completion)

    def _requests(self) -> Iterator[GenerationRequest | None]:
        """The engine's request source: ends (closing this `generate`) when stopping or a weight update waits
        and nothing is in flight; blocks only when the engine is idle."""
        while True:
            if self._update is not None or self._stopping():
                if not self._pending:
                    return
                yield None  # let the requests in flight finish first
                continue
            try:
                request, future = self._inbox.get(block=not self._pending, timeout=_IDLE_CHECK_S)
            except queue.Empty:
                yield None
                continue
            if not future.set_running_or_notify_cancel():
                continue
            self._pending[request.request_id] = future
            self._in_flight[request.request_id] = request
            if request.on_tokens is not None and not self.streams_tokens:
                self._deliver_at_end[request.request_id] = request.on_tokens
                request.on_tokens = None
            elif request.on_tokens is not None:
                request.on_tokens = self._noting_streamed(request.request_id, request.on_tokens)
            yield request

    def _noting_streamed(self, request_id: int, on_tokens: TokenCallback) -> TokenCallback:
        def deliver(token_ids: list[int], logprobs: list[float]) -> None:
            self._streamed.add(request_id)
            on_tokens(token_ids, logprobs)

        return deliver

    def _apply_update(self) -> None:
        if self._update is None:
            return
        state_dict, version, done = self._update
        try:
            self.engine.update_weights(state_dict, version)
        except BaseException as error:
            done.set_exception(error)
        else:
            done.set_result(None)
        finally:
            with self._lock:
                self._update = None

    def _stopping(self) -> bool:
        return self._closed and self._inbox.empty()

    def _drain_inbox(self) -> list[Future[Completion]]:
        futures: list[Future[Completion]] = []
        while True:
            try:
                futures.append(self._inbox.get_nowait()[1])
            except queue.Empty:
                return futures


def _guarded(on_tokens: TokenCallback) -> TokenCallback:
    """`on_tokens` that logs what it raises instead of raising it into the loop every caller shares."""
    failed = False

    def deliver(token_ids: list[int], logprobs: list[float]) -> None:
        nonlocal failed
        if failed:
            return
        try:
            on_tokens(token_ids, logprobs)
        except Exception:  # the consumer's bug; its request still completes
            failed = True
            log.exception("a token callback raised; its request goes on without it")

    return deliver
