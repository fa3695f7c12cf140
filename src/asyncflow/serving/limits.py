"""The limits `asyncflow serve` puts on every request and connection, so that no client can stall or crash it.

Owns: `ServingLimits` (pydantic; each field is a `--flag` of `asyncflow serve`, see docs/serving-limits.md).
Plain Python: the HTTP layer (`api`, `server`) enforces these values, this module only holds and checks them.

Invariants: every limit is finite and positive, so each request costs bounded CPU, memory and time before the
server answers it (a 4xx naming the field when a request is over a limit); the connections still sending a
request have a budget of their own, apart from `max_connections`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ServingLimits(BaseModel):
    """Per-request and per-connection bounds of the OpenAI-compatible server."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(2 * 1024 * 1024, ge=1024, description=(
        "Largest request body in bytes; a larger one (by Content-Length or as it arrives) gets 413."))
    max_json_items: int = Field(200_000, ge=1000, description=(
        "Most JSON items in a request body (its commas, '[' and '{', counted before parsing: a bound on its "
        "values); more gets 400 naming `body` before the body is parsed."))
    max_prompt_chars: int = Field(200_000, ge=1, description=(
        "Longest prompt in characters (a completion prompt; for chat, the text the chat template renders from "
        "every field of every message); checked before tokenising, 400 naming `prompt` / `messages`."))
    max_messages: int = Field(1024, ge=1, description="Most messages in one chat request (400 naming `messages`).")
    max_stop_strings: int = Field(8, ge=1, description="Most stop strings one request may give (400 naming `stop`).")
    max_stop_chars: int = Field(128, ge=1, description="Longest stop string in characters (400 naming `stop`).")
    max_choices: int = Field(64, ge=1, description=(
        "Most samples one request may ask for: prompts x n (400 naming `n`)."))
    header_timeout_s: float = Field(10.0, gt=0, description=(
        "Seconds a connection has to send a whole request head (from connecting, or from the first byte of "
        "its next request); a slow or half-open client is then disconnected."))
    body_timeout_s: float = Field(30.0, gt=0, description=(
        "Seconds a request body has to arrive whole, from the end of its head; a slow or stalled upload gets 408."))
    keep_alive_s: int = Field(30, ge=1, description="Seconds an idle keep-alive connection is kept open.")
    max_header_bytes: int = Field(16 * 1024, ge=1024, description=(
        "Largest request head (request line and headers) in bytes, however it arrives; a larger one gets 431."))
    max_connections: int = Field(1024, ge=1, description=(
        "Most connections holding a whole request or kept alive after one (the API closes a connection after a "
        "request without the key); beyond it a request gets 503 at once. Connections still sending a request "
        "do not count (see --max-pending-connections)."))
    max_pending_connections: int = Field(256, ge=1, description=(
        "Most connections still sending a request (head or body) or silent since connecting; a new connection "
        "beyond it closes the oldest of them that has had 1-2 s to send its request."))
    max_pending_per_client: int = Field(64, ge=1, description=(
        "As --max-pending-connections, for the connections from one client address."))

