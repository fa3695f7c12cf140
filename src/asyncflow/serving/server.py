"""Running the OpenAI-compatible API with uvicorn: in the foreground (`asyncflow serve`) or on a thread
(the agent rollout of a training run, tests).

Owns: `ServerThread` (start with a bounded wait, the bound port, stop), `serve_forever`, `bind` (the socket,
bound before the model loads, listening once the server starts), and the connection limits of `ServingLimits`:
uvicorn's keep-alive timeout, and what uvicorn lacks, in `_GuardedProtocol` (its h11 protocol, extended): a
deadline for the whole request head, a head size limit however the head arrives, and `ConnectionBudget`, which
keeps the connections still sending a request apart from those that hold one. The event loop is uvloop where it is
installed (the `serve` extra; else asyncio's): under connection floods it answers the others several times sooner.

Invariants:
- A started server listens on `host` only (loopback unless asked otherwise); `start` returns only once it
  accepts connections, or raises within its timeout.
- A connection that has not sent a whole request head within `header_timeout_s` of connecting (or of its first
  byte after a response) is closed, however slowly it trickles; a head over `max_header_bytes` gets 431 and the
  connection is closed, whether it came in one piece or many; an idle kept-alive connection is closed after
  `keep_alive_s`.
- A connection is *pending* from connecting (or from the first byte of its next request) until its request has
  arrived whole, head and body. Pending connections never count against `max_connections`: they cannot make
  a whole request wait or get 503, however many there are. A new connection beyond `max_pending_connections`
  pending (or `max_pending_per_client` from its address) closes the oldest pending ones that have had their
  `PENDING_GRACE_S` (1-2 s) to send their request, so a client that sends its request within a second is never
  closed to make room, and the open sockets stay within the budget plus those opened in the last two seconds.
- `max_connections` counts the connections holding a whole request or kept alive after one; a request head
  that arrives while they are that many gets 503 at once. (The API closes the connection after a request
  without the key, so only authorised requests leave a connection open.)
- A closed connection is freed by reference counting: nothing of it is left in a cycle for the garbage collector,
  whose full passes (the longer, the more a flood left) would hold the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import random
import socket
import threading
import time
from collections import OrderedDict

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from asyncflow.serving.limits import ServingLimits

PENDING_GRACE_S = (1.0, 2.0)
"""A pending connection is never closed to make room for another before it is this old: a time drawn in this range
for each (a flood's connections, opened together, are then closed, and reopened, a few at a time)."""


class ConnectionBudget:
    """The open connections of one server and which of them are pending (module docstring), oldest first.

    Plain bookkeeping, no I/O: `pending` says which connections to close to make room, the caller closes them.
    """

    def __init__(self, limits: ServingLimits):
        self.max_admitted = limits.max_connections
        self.max_pending = limits.max_pending_connections
        self.max_pending_per_client = limits.max_pending_per_client
        # OrderedDict: finding the oldest stays O(1) however many were removed before it (a dict's does not)
        self._open: set = set()
        self._pending: OrderedDict = OrderedDict()  # connection -> (client address, closable from), oldest first
        self._pending_by_client: dict[str, OrderedDict] = {}

    def opened(self, connection) -> None:
        self._open.add(connection)

    def closed(self, connection) -> None:
        self._open.discard(connection)
        self.admitted(connection)

    def full(self) -> bool:
        """Whether as many connections as `max_connections` hold a request or are kept alive after one."""
        return len(self._open) - len(self._pending) >= self.max_admitted

    def pending(self, connection, client: str, now: float) -> list:
        """`connection` (from `client`) starts sending a request: the pending connections to close to make room."""
        self.admitted(connection)  # a connection sending its next request goes to the back of the line
        closing = []
        while (oldest := self._oldest_to_close(client, now)) is not None:
            closing.append(oldest)
            self.closed(oldest)
        self._pending[connection] = (client, now + random.uniform(*PENDING_GRACE_S))
        self._pending_by_client.setdefault(client, OrderedDict())[connection] = None
        return closing

    def _oldest_to_close(self, client: str, now: float):
        """The oldest pending connection of `client` if it has its limit pending, else the oldest of all if they are
        at theirs; None if there is room or that connection has not had its `PENDING_GRACE_S` yet."""
        mine = self._pending_by_client.get(client, ())
        if len(mine) >= self.max_pending_per_client:
            line = mine
        elif len(self._pending) >= self.max_pending:
            line = self._pending
        else:
            return None
        oldest = next(iter(line))
        return oldest if now >= self._pending[oldest][1] else None

    def admitted(self, connection) -> None:
        """`connection`'s request has arrived whole (or it closed): it is no longer pending."""
        client, _ = self._pending.pop(connection, (None, 0.0))
        if client is not None:
            mine = self._pending_by_client[client]
            del mine[connection]
            if not mine:
                del self._pending_by_client[client]


def _head_bytes(head: h11.Request) -> int:
    """The size of a request head as parsed: request line and headers with their separators."""
    line = len(head.method) + len(head.target) + len(b"  HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in head.headers.raw_items()) + 2


class _H11Connection(h11.Connection):
    """h11's server side, handing each parsed request head to `on_head` (which may refuse it by raising
    `h11.RemoteProtocolError`) and keeping the status h11 suggests for a refused request."""

    def __init__(self, max_incomplete_event_size: int, on_head):
        super().__init__(h11.SERVER, max_incomplete_event_size=max_incomplete_event_size)
        self.on_head = on_head
        self.refused_with = 400

    def next_event(self):
        try:
            event = super().next_event()
            if isinstance(event, h11.Request) and self.on_head is not None:
                self.on_head(event)
            return event
        except h11.RemoteProtocolError as err:
            self.refused_with = err.error_status_hint
            raise


class _GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol with the connection limits of the module docstring: the whole head within
    `header_timeout_s` (uvicorn's keep-alive timer covers an idle connection but restarts on every byte), its size
    checked once parsed (h11 checks only a head still incomplete), and the connection's place in `budget`."""

    def __init__(self, *args, limits: ServingLimits, budget: ConnectionBudget, **kwargs):
        super().__init__(*args, **kwargs)
        self._guarded_conn = self.conn = _H11Connection(limits.max_header_bytes, self._check_head)
        self._limits, self._budget = limits, budget
        self._head_timer: asyncio.TimerHandle | None = None
        # while a request is arriving: the cycle before it (its head replaces `cycle`)
        self._sending_after: RequestResponseCycle | None = None
        self._sending = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._budget.opened(self)
        self._request_started()

    def _request_started(self) -> None:
        """A request starts arriving (connected, or the first byte after a response): pending until it is whole."""
        self._sending, self._sending_after = True, self.cycle
        self._head_timer = self.loop.call_later(self._limits.header_timeout_s, self._head_timed_out, self.cycle)
        client = self.client[0] if self.client else ""
        for other in self._budget.pending(self, client, self.loop.time()):
            other.transport.close()

    def _head_timed_out(self, waiting_after) -> None:
        if self.cycle is waiting_after and not self.transport.is_closing():
            self.transport.close()

    def _check_head(self, head: h11.Request) -> None:
        if _head_bytes(head) > self._limits.max_header_bytes:
            raise h11.RemoteProtocolError("request head over max_header_bytes", error_status_hint=431)
        self.limit_concurrency = 0 if self._budget.full() else None  # uvicorn answers 503 when it is 0

    def _check_request_arrived(self) -> None:
        if self._sending and self.cycle is not self._sending_after and not self.cycle.more_body:
            self._sending = False
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._budget.admitted(self)

    def data_received(self, data: bytes) -> None:
        if not self._sending:
            self._request_started()
        super().data_received(data)
        self._check_request_arrived()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._check_request_arrived()  # a pipelined request, handled by uvicorn from its buffer

    def connection_lost(self, exc) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._budget.closed(self)
        super().connection_lost(exc)
        # Cut the cycles through this protocol (its h11 connection's hook, its timer), so that a closed connection
        # is freed at once: a flood's thousands of closed connections otherwise pile up for the collector's full
        # passes, each of which holds the event loop.
        self._guarded_conn.on_head = None
        self._head_timer = self._sending_after = None

    def send_400_response(self, msg: str) -> None:
        if self._guarded_conn.refused_with != 431:
            return super().send_400_response(msg)
        body = f"request head over {self._limits.max_header_bytes} bytes (limits.max_header_bytes)".encode()
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain\r\n"
                             b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` (0: a free port, see `getsockname()`); it listens once served, so until
    then connections are refused. Raises OSError when the address cannot be bound."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _server(app, limits: ServingLimits | None) -> uvicorn.Server:
    limits = limits or ServingLimits()
    protocol = functools.partial(_GuardedProtocol, limits=limits, budget=ConnectionBudget(limits))
    return uvicorn.Server(uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="off", ws="none", loop="auto",
        http=protocol,  # type: ignore[arg-type]  # uvicorn calls it like a protocol class
        timeout_keep_alive=limits.keep_alive_s, h11_max_incomplete_event_size=limits.max_header_bytes,
    ))


class ServerThread:
    """The app served by uvicorn on a daemon thread. `port=0` takes a free port (see `port` once started)."""

    def __init__(self, app, *, host: str = "127.0.0.1", port: int = 0, limits: ServingLimits | None = None):
        self.host = host
        self._server = _server(app, limits)
        self._requested_port = port
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def start(self, timeout: float = 30.0) -> ServerThread:
        sock = bind(self.host, self._requested_port)
        self.port = sock.getsockname()[1]
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="openai-server",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise OSError(f"the HTTP server did not start on {self.host}:{self.port}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the HTTP server did not start within {timeout:.0f} s")
            time.sleep(0.01)
        return self

    @property
    def url(self) -> str:
        """The server's root, e.g. `http://127.0.0.1:8000` (append `/v1` for an OpenAI client's base_url)."""
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        if self._thread is None:
            return  # never started
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the HTTP server did not stop within {timeout:.0f} s")


def serve_forever(app, sock: socket.socket, *, limits: ServingLimits | None = None, on_listening=None) -> None:
    """Serve on `sock` (from `bind`) in this thread until Ctrl-C / SIGTERM; `on_listening()` once connections
    are accepted into its queue."""
    server = _server(app, limits)
    # The model, tokenizer and app live as long as the process: frozen, the collector's full passes skip them
    # (400k objects: a full pass took ~0.4 s of the event loop's thread, ~0.13 s once frozen, under connection floods)
    gc.freeze()
    sock.listen(server.config.backlog)
    if on_listening is not None:
        on_listening()
    server.run(sockets=[sock])
