"""`GET /metrics` of `asyncflow serve`: Prometheus series of what the server answered and sampled.

Owns: `ServeMeter` (its own registry, the ASGI layer that counts every request, the exposition).

Series: `asyncflow_serve_requests_total{route,status}` and `asyncflow_serve_request_seconds{route}` (until the
response, a stream's last byte included), `asyncflow_serve_requests_in_flight`, `asyncflow_serve_choices_total
{finish_reason}`, `asyncflow_serve_completion_tokens_total`, `asyncflow_serve_prompt_tokens_total`,
`asyncflow_serve_prompt_tokens_cached_total` (from the engine's prefix cache, where the engine reports it),
`asyncflow_serve_weight_version` (of the last choice) and, read at each scrape, `asyncflow_serve_healthy` and
`asyncflow_serve_engine_failures`.

Invariants:
- Labels are bounded: `route` is one of the API's routes (an episode's id is written `*`) or `other`; `status` is
  the HTTP status sent (`closed` when the client went away before one was).
- `/metrics` needs the API key like every route but `/health` (the `Authorize` layer sits inside this one);
  counting costs a few dictionary operations per request, nothing per token.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")
_EPISODE = re.compile(r"^/episodes/[^/]+")


def route_label(path: str) -> str:
    """`/episodes/abc/v1/completions` -> `/episodes/*/v1/completions`; a path outside the API -> `other`."""
    inner = _EPISODE.sub("", path)
    if inner not in ROUTES:
        return "other"
    return inner if inner == path else "/episodes/*" + inner


class _Health(Collector):
    def __init__(self, health: Callable[[], dict]) -> None:
        self.health = health

    def collect(self) -> Iterator[GaugeMetricFamily]:
        health = self.health()
        yield GaugeMetricFamily("asyncflow_serve_healthy", "1 while a request would be served",
                                value=float(health["status"] == "ok"))
        yield GaugeMetricFamily("asyncflow_serve_engine_failures", "engine errors survived so far",
                                value=float(health["engine_failures"]))


class ServeMeter:
    """Counts what the server does; `layer(app)` wraps the ASGI app, `choice(...)` is called once per choice."""

    def __init__(self, health: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter("asyncflow_serve_requests", "requests answered", ["route", "status"], registry=r)
        self.seconds = Histogram("asyncflow_serve_request_seconds", "seconds until the last byte of the answer",
                                 ["route"], registry=r,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
        self.in_flight = Gauge("asyncflow_serve_requests_in_flight", "requests being answered", registry=r)
        self.choices = Counter("asyncflow_serve_choices", "choices sampled", ["finish_reason"], registry=r)
        self.completion_tokens = Counter("asyncflow_serve_completion_tokens", "tokens sampled", registry=r)
        self.prompt_tokens = Counter("asyncflow_serve_prompt_tokens", "prompt tokens of the choices", registry=r)
        self.cached_prompt_tokens = Counter(
            "asyncflow_serve_prompt_tokens_cached", "prompt tokens taken from the engine's prefix cache (engines that "
            "report it: vLLM); divided by asyncflow_serve_prompt_tokens_total: the prefix-cache hit rate", registry=r)
        self.weight_version = Gauge("asyncflow_serve_weight_version", "policy version of the last choice", registry=r)
        r.register(_Health(health))

    def choice(self, prompt_tokens: int, completion_tokens: int, finish_reason: str, weight_version: int,
               cached_prompt_tokens: int | None = None) -> None:
        self.choices.labels(finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_prompt_tokens.inc(cached_prompt_tokens or 0)
        self.completion_tokens.inc(completion_tokens)
        self.weight_version.set(weight_version)

    def exposition(self) -> tuple[bytes, str]:
        """The text a scrape gets, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def layer(self, app):
        """ASGI middleware counting each HTTP request by route and status, with its duration."""

        async def metered(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            route, status, start = route_label(scope["path"]), "closed", time.perf_counter()

            async def send_counted(message):
                nonlocal status
                if message["type"] == "http.response.start":
                    status = str(message["status"])
                await send(message)

            self.in_flight.inc()
            try:
                await app(scope, receive, send_counted)
            finally:
                self.in_flight.dec()
                self.requests.labels(route, status).inc()
                self.seconds.labels(route).observe(time.perf_counter() - start)

        return metered
