"""Running the OpenAI-compatible API with uvicorn: in the foreground (`asyncflow serve`) or on a thread
(the agent rollout of a training run, tests).

Owns: `ServerThread` (start with a bounded wait, the bound port, stop), `serve_forever` and the connection
limits of `ServingLimits` (uvicorn's keep-alive timeout, head size and concurrency limits, and a head timeout
uvicorn lacks: `_HeadTimeoutProtocol`).

Invariants: a started server listens on `host` only (loopback unless asked otherwise); `start` returns only
once it accepts connections, or raises within its timeout. A connection that has not sent a whole request head
within `header_timeout_s` of connecting (or of its first byte after a response) is closed, however slowly it
trickles; an idle kept-alive connection is closed after `keep_alive_s`.
"""

from __future__ import annotations

import functools
import threading
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from asyncflow.serving.limits import ServingLimits


class _HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is not complete within `head_timeout_s` of
    connecting, or of the first byte after a response (a half-open or trickling client: uvicorn's own keep-alive
    timer covers an idle connection but restarts on every byte received)."""

    def __init__(self, *args, head_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self._head_timeout_s = head_timeout_s
        self._head_timer = None

    def _arm_head_timer(self) -> None:
        waiting_after = self.cycle  # a new request head replaces `cycle`
        self._head_timer = self.loop.call_later(self._head_timeout_s, self._head_timed_out, waiting_after)

    def _head_timed_out(self, waiting_after) -> None:
        if self.cycle is waiting_after and not self.transport.is_closing():
            self.transport.close()

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None:  # the first byte of the next request on a kept-alive connection
            self._arm_head_timer()
        super().data_received(data)

    def on_response_complete(self) -> None:
        self._disarm_head_timer()  # idle from here: uvicorn's keep-alive timeout applies
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)


def _config(app, host: str, port: int, limits: ServingLimits | None) -> uvicorn.Config:
    limits = limits or ServingLimits()
    return uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
        http=functools.partial(_HeadTimeoutProtocol, head_timeout_s=limits.header_timeout_s),
        timeout_keep_alive=limits.keep_alive_s, h11_max_incomplete_event_size=limits.max_header_bytes,
        limit_concurrency=limits.max_connections,
    )


class ServerThread:
    """The app served by uvicorn on a daemon thread. `port=0` takes a free port (see `port` once started)."""

    def __init__(self, app, *, host: str = "127.0.0.1", port: int = 0, limits: ServingLimits | None = None):
        self.host = host
        self._server = uvicorn.Server(_config(app, host, port, limits))
        self._thread = threading.Thread(target=self._server.run, name="openai-server", daemon=True)
        self.port: int | None = None

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise OSError(f"the HTTP server did not start on {self.host} (is the port in use?)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the HTTP server did not start within {timeout:.0f} s")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        """The server's root, e.g. `http://127.0.0.1:8000` (append `/v1` for an OpenAI client's base_url)."""
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the HTTP server did not stop within {timeout:.0f} s")


def serve_forever(app, *, host: str, port: int, limits: ServingLimits | None = None) -> None:
    """Serve in this thread until Ctrl-C / SIGTERM."""
    uvicorn.Server(_config(app, host, port, limits)).run()
