"""Running the OpenAI-compatible API with uvicorn: in the foreground (`asyncflow serve`) or on a thread
(the agent rollout of a training run, tests).

Owns: `ServerThread` (start with a bounded wait, the bound port, stop) and `serve_forever`.

Invariant: a started server listens on `host` only (loopback unless asked otherwise); `start` returns only
once it accepts connections, or raises within its timeout.
"""

from __future__ import annotations

import threading
import time

import uvicorn


def _config(app, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                          timeout_keep_alive=30)


class ServerThread:
    """The app served by uvicorn on a daemon thread. `port=0` takes a free port (see `port` once started)."""

    def __init__(self, app, *, host: str = "127.0.0.1", port: int = 0):
        self.host = host
        self._server = uvicorn.Server(_config(app, host, port))
        self._thread = threading.Thread(target=self._server.run, name="openai-server", daemon=True)
        self.port: int | None = None

    def start(self, timeout: float = 30.0) -> "ServerThread":
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


def serve_forever(app, *, host: str, port: int) -> None:
    """Serve in this thread until Ctrl-C / SIGTERM."""
    uvicorn.Server(_config(app, host, port)).run()
