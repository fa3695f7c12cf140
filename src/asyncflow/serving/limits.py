"""The limits `asyncflow serve` puts on every request and connection, so that no client can stall or crash it.

Owns: `ServingLimits` (pydantic; each field is a `--flag` of `asyncflow serve`, see docs/serving-limits.md).
Plain Python: the HTTP layer (`api`, `server`) enforces these values, this module only holds and checks them.

Invariant: every limit is finite and positive, so each request costs bounded CPU, memory and time before the
server answers it (a 4xx naming the field when a request is over a limit).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ServingLimits(BaseModel):
    """Per-request and per-connection bounds of the OpenAI-compatible server."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(2 * 1024 * 1024, ge=1024, description=(
        "Largest request body in bytes; a larger one (by Content-Length or as it arrives) gets 413."))
    max_prompt_chars: int = Field(200_000, ge=1, description=(
        "Longest prompt in characters (a completion prompt; for chat, all messages' content together); "
        "checked before tokenising, 400 naming `prompt` / `messages`."))
    max_stop_strings: int = Field(8, ge=1, description="Most stop strings one request may give (400 naming `stop`).")
    max_stop_chars: int = Field(128, ge=1, description="Longest stop string in characters (400 naming `stop`).")
    max_choices: int = Field(64, ge=1, description=(
        "Most samples one request may ask for: prompts x n (400 naming `n`)."))
    header_timeout_s: float = Field(10.0, gt=0, description=(
        "Seconds a connection has to send a complete request head (from connecting, or from the first byte of "
        "its next request); a slow or half-open client is then disconnected."))
    body_timeout_s: float = Field(30.0, gt=0, description=(
        "Seconds the server waits for each piece of a request body; a stalled upload gets 408."))
    keep_alive_s: int = Field(30, ge=1, description="Seconds an idle keep-alive connection is kept open.")
    max_header_bytes: int = Field(16 * 1024, ge=1024, description=(
        "Largest request head (request line and headers) in bytes; a larger one is refused (431/400)."))
    max_connections: int = Field(1024, ge=1, description=(
        "Most concurrent connections and requests; beyond it new requests get 503 at once (uvicorn's "
        "limit_concurrency)."))
