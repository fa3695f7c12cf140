"""An OpenAI-compatible HTTP API over an `EngineService`: `/v1/models`, `/v1/completions`, `/v1/chat/completions`
(and `/metrics`, `asyncflow.serving.metering`).

Owns: the request models (pydantic), their parsing and checks, prompt rendering (the tokenizer's chat template, given
a chat request's `tools` too), stop strings, the responses (plain and server-sent events) and the OpenAI error shape.
Built with FastAPI; this package is the only one that imports the HTTP stack.

Extra fields (beyond OpenAI's): each choice carries `token_ids` (the ids sampled), `token_logprobs` (their
sampling log-probs), `prompt_token_ids` and `weight_version` (the policy version that sampled them); a
streamed chunk carries the `token_ids` / `token_logprobs` of its piece, and the last chunk of a choice also
`prompt_token_ids` and `weight_version`. `top_k` may be given besides OpenAI's sampling fields.

Streaming (`stream: true`) is token by token: the engine hands each choice's tokens to the request as they are
sampled (`EngineService.submit(on_tokens=...)`), and each step's tokens go out as one server-sent event
(choices of `n > 1` interleaved, each chunk naming its `index`); tokens that arrived while the previous
chunk was being sent go out together, one chunk per choice (a slow reader gets fewer, larger chunks).
`TextStream` turns a choice's ids into text that is never taken back: it holds back a tail that does not
decode cleanly yet (part of a multi-byte character), trailing whitespace (a decoder may still merge it with
what follows) and a tail that could be the start of a stop string. An engine without `streams_tokens` still
streams, a choice at a time when it finishes (`/v1/models` says which: `"streaming": "token"` or `"choice"`).

Tool calling (`asyncflow.serving.tool_calling`, docs/serving.md): chat `tools` are rendered by the chat template
(a template that renders nothing of them: 400 naming `tools`) and, unless `tool_choice` is "none", each choice's
text is parsed in the model's `ServedModel.tool_call_format` into `message.tool_calls` / `delta.tool_calls`
(text whose calls are malformed is content); a stream holds the text back from the first call's opening on until
the choice is parsed. `tool_choice` "required" or a named function is not enforced on the sampling.

Episodes (training an agent through this server): `/episodes/{episode_id}/v1/...` serves the same routes
and records every call under the episode (`asyncflow.serving.episodes`); only episodes the training driver
opened are served. A call whose prompt text starts with the episode's latest context (the previous prompt
text and its completion, as that call returned it) is tokenized as that context's ids followed by the
new text's ids, so the ids sampled earlier reach the model, and the training row, unchanged.

Invariants:
- Every request needs `Authorization: Bearer <key>`; without it, or with another key: 401 (`GET /health`
  alone answers without a key: 200 while the engine serves, 503 when it cannot, with its failure count).
  Both answers close the connection, so only a request with the key leaves a connection open (the server
  counts the connections still sending a request apart: `asyncflow.serving.server`).
- No request can hurt another (`ServingLimits`, docs/serving-limits.md): the body is read whole, within a size
  limit (413) and a deadline (408), before the app sees it; parsing and validation (`parse_request`) run on a
  worker thread in time bounded by the limits, not by the body: its JSON items are counted before parsing, the
  counts of messages and stop strings before validation, and an array's validation stops at its first bad item
  (one small error naming the field); prompt length (chat: everything the template rendered), stop strings
  and prompts x n are bounded before tokenising (400 naming the field); sampling settings are finite and in
  ranges that cannot make NaN; token ids are checked before anything decodes them; tokenising, chat templates
  and decoding run on worker threads, never on the event loop; stop strings are matched in linear time. An
  error inside the engine fails the requests it was running (503) and the engine serves the next one.
- Bad input (malformed JSON, an unknown field or model, a value out of range, a prompt too long for the
  model, token ids outside the vocabulary, a chat template that fails) is refused with a 4xx JSON error
  `{"error": {"message", "type", "param", "code"}}` before it reaches the engine, so no request can stop
  the generation loop that other callers share. A call still unanswered after `request_timeout_s` gets 504.
- A streamed choice is the non-streamed one cut in pieces: its chunks' `text` (chat: `delta.content`),
  `token_ids` and `token_logprobs` concatenate to exactly the non-streamed values (given the same samples),
  with a stop string honoured across chunk boundaries; `finish_reason` is on its last chunk, sent once the
  engine's completion arrives (the engine stops at one-token stops only, so a longer stop string found in the
  text ends the choice's pieces at once but its last chunk waits for that). `data: [DONE]` ends the stream.
- Every check above happens before a stream starts; a failure after it started (the engine stopped, the
  timeout) ends the stream with one event `{"error": {...}}` in OpenAI's shape (the `openai` client raises it)
  and no `[DONE]`, never a hang. A client that goes away mid-stream has its tokens dropped from then on; the
  engine finishes its samples (they cannot be cut short) and other callers are not affected.
- An episode call is recorded once its completion arrives, streamed or not, as it was returned.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from asyncflow.engines.base import Completion, SamplingParams
from asyncflow.engines.service import EngineService, EngineServiceError
from asyncflow.engines.torch_inference import MIN_TEMPERATURE
from asyncflow.serving.episodes import CallRecord, EpisodeRecorder, UnknownEpisodeError
from asyncflow.serving.limits import ServingLimits
from asyncflow.serving.metering import ServeMeter
from asyncflow.serving.router import ReplicaRouter
from asyncflow.serving.tool_calling import (
    TOOL_CALL_FORMATS,
    Tool,
    ToolChoice,
    ToolTurn,
    parse_turn,
    sampled_turns,
    template_messages,
)

log = logging.getLogger(__name__)


@dataclass
class ServedModel:
    """What the API serves. `service` may be swapped between requests (the training driver runs one per step)."""

    name: str
    tokenizer: Any
    service: EngineService | ReplicaRouter | None
    """One engine service, or several replicas behind a router (`asyncflow.serving.router`)."""
    max_model_len: int
    """Prompt plus completion, in tokens (the model's position limit)."""
    vocab_size: int
    chat_template: str | None = None
    """Jinja chat template overriding the tokenizer's own (None: the tokenizer's)."""
    eos_token_ids: tuple[int, ...] = ()
    """Ids that end a sample besides the tokenizer's EOS: the model's generation config's (`<|endoftext|>` beside
    `<|im_end|>` for ChatML models), as the rollout engine stops (`asyncflow.workflow.setup.sampling_params`)."""
    episode_sampling: SamplingParams | None = None
    """Training: episode calls sample with its temperature, top-p and top-k whatever the agent asks (the trainer
    recomputes log-probs at that temperature), and at most its `max_new_tokens` per call."""
    tool_call_format: str = "hermes"
    """How this model writes tool calls: a key of `serving.tool_calling.TOOL_CALL_FORMATS`."""


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, **fields) -> JSONResponse:
    return JSONResponse(error_body(message, **fields), status)


def closing(response: Response) -> Response:
    """`response`, after which the connection is closed (so the server counts it no longer: `serving.server`)."""
    response.headers["connection"] = "close"
    return response


class APIError(Exception):
    """A request refused with `status` and an `error_body(message, **fields)`."""

    def __init__(self, status: int, message: str, **fields):
        super().__init__(message)
        self.status, self.body = status, error_body(message, **fields)


# ---------------------------------------------------------------- requests
T = TypeVar("T")
Items = Annotated[list[T], Field(fail_fast=True)]
"""A JSON array whose validation stops at its first bad item: one error, not one per item."""


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # NaN / Infinity in the JSON: 400

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # -1 or 0: off
    n: int = Field(1, ge=1, le=64)
    stop: Items[str] = Field(default_factory=list)  # a string or null as written: a list of 1 or 0 (`_stop_list`)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    seed: int | None = None  # accepted and ignored: the engine's one generator is shared by every caller
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @field_validator("temperature")
    @classmethod
    def _finite_temperature(cls, value: float) -> float:
        if 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE} (a smaller one overflows to NaN)")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, value: float) -> float:
        if value != 0:
            raise ValueError("penalties are not supported by this server (leave them 0)")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else [] if value is None else value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stops: list[str]) -> list[str]:
        if any(not s for s in stops):
            raise ValueError("stop strings may not be empty")
        return stops  # count and length: `ServingLimits`, checked by the API (`parse_request`, `_check_size`)


class CompletionRequest(_Sampling):
    prompt: str | Items[int] | Items[str] | Items[Items[int]]
    logprobs: int | None = Field(None, ge=0, le=1)  # only the sampled token's log-prob is known
    echo: Literal[False] = False


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_call_id, name, ...: handed to the chat template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Items[_TextPart] | None = None


class ChatRequest(_Sampling):
    messages: Items[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=1)  # only the sampled token's log-prob is known
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: Items[Tool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # accepted; not enforced (docs/serving.md)

    def tool_choice_or_default(self) -> ToolChoice:
        return self.tool_choice if self.tool_choice is not None else "auto" if self.tools else "none"


# ---------------------------------------------------------------- the app
def make_app(served: ServedModel, *, api_key: str, recorder: EpisodeRecorder | None = None,
             request_timeout_s: float = 600.0, limits: ServingLimits | None = None):
    """The ASGI app: the FastAPI routes behind `Authorize` and `BufferedBody`, plain ASGI layers in front of FastAPI
    so that a connection still sending its body costs no more than a coroutine waiting for it. Run it with
    uvicorn (`asyncflow.serving.server`, with the same `limits`)."""
    if not api_key:
        raise ValueError("the server needs an API key")
    limits = limits or ServingLimits()
    app = FastAPI(title="asyncflow OpenAI-compatible server", docs_url=None, redoc_url=None, openapi_url=None)
    api = _API(served, recorder, request_timeout_s, limits)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return JSONResponse(err.body, err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException):
        return error_response(err.status_code, str(err.detail), code="not_found" if err.status_code == 404 else None)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):  # a bug here: the engine loop is not affected
        return error_response(500, f"internal error: {type(err).__name__}: {err}", type="server_error")

    app.add_api_route("/metrics", api.metrics, methods=["GET"])
    for prefix in ("", "/episodes/{episode_id}"):
        app.add_api_route(prefix + "/v1/models", api.models, methods=["GET"])
        app.add_api_route(prefix + "/v1/completions", api.completions, methods=["POST"])
        app.add_api_route(prefix + "/v1/chat/completions", api.chat, methods=["POST"])
    # The key is checked first: no body of a client without it is read.
    buffered = BufferedBody(app, max_bytes=limits.max_body_bytes, timeout_s=limits.body_timeout_s)
    return api.meter.layer(Authorize(buffered, api_key=api_key, health=api.health))


def parse_request(raw: bytes, model: type[BaseModel], limits: ServingLimits):
    """The request `model` in the JSON body `raw`, in time bounded by `limits` whatever the body holds: its items are
    counted before it is parsed, the arrays with a limit are measured before validation, and validation stops at an
    array's first bad item. Raises `APIError` (400 naming the field, one error however many items are bad)."""
    items = sum(raw.count(c) for c in (b",", b"[", b"{"))
    if items > limits.max_json_items:
        raise APIError(400, f"body: {items} JSON items (commas, '[' and '{{') is over the limit of "
                       f"{limits.max_json_items} (limits.max_json_items)", param="body")
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply") from None
    except ValueError as err:
        raise APIError(400, f"malformed JSON body: {err}") from None
    if not isinstance(data, dict):
        raise APIError(400, "body: a JSON object is expected", param="body")
    for field, key in (("messages", "max_messages"), ("stop", "max_stop_strings")):
        if isinstance(data.get(field), list) and len(data[field]) > (limit := getattr(limits, key)):
            raise APIError(400, f"{field}: {len(data[field])} items is over the limit of {limit} (limits.{key})",
                           param=field)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        raise APIError(400, f"{where or 'body'}: {first['msg']}", param=where or None) from None


class Authorize:
    """ASGI middleware: `GET /health` answers without the key (`health()`); any other request without
    `Authorization: Bearer <api_key>` gets 401. Both answers close the connection (module docstring). Plain ASGI:
    a request costs no task or stream of its own here (a flood of connections is cheap to refuse)."""

    def __init__(self, app, *, api_key: str, health):
        self.app, self.expected, self.health = app, f"Bearer {api_key}".encode(), health

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] == "/health":
            response = await self.health()
        else:
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if hmac.compare_digest(given, self.expected):
                return await self.app(scope, receive, send)
            response = error_response(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                                      code="invalid_api_key")
        await closing(response)(scope, receive, send)


class BufferedBody:
    """ASGI middleware: read an HTTP request's body whole before the app runs, at most `max_bytes` (413) and
    within `timeout_s` of starting (408), then hand the app that body (nothing, if the client went away first);
    later `receive` calls (a disconnect during a streamed answer) go to the client as usual."""

    def __init__(self, app, *, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            body = await self._read(scope, receive)
        except APIError as err:
            return await closing(JSONResponse(err.body, err.status))(scope, receive, send)
        if body is None:  # the client went away: nobody to answer
            return
        first = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay():
            return first.pop() if first else await receive()

        await self.app(scope, replay, send)

    async def _read(self, scope, receive) -> bytes | None:
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            raise APIError(413, f"body: {int(declared)} bytes is over the limit of {self.max_bytes} "
                           "(limits.max_body_bytes)", param="body", code="body_too_large")
        try:
            return await asyncio.wait_for(self._pieces(receive), self.timeout_s)
        except asyncio.TimeoutError:
            raise APIError(408, f"body: not received whole within {self.timeout_s:g} s (limits.body_timeout_s)",
                           param="body", code="body_timeout") from None

    async def _pieces(self, receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise APIError(413, f"body: over the limit of {self.max_bytes} bytes (limits.max_body_bytes)",
                               param="body", code="body_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _API:
    def __init__(self, served: ServedModel, recorder: EpisodeRecorder | None, timeout_s: float,
                 limits: ServingLimits):
        self.served = served
        self.recorder = recorder
        self.timeout_s = timeout_s
        self.limits = limits
        self.told_choice_streaming = False
        self.meter = ServeMeter(self._health)

    def _health(self) -> dict:
        service = self.served.service
        return {"status": "ok" if service is not None and service.healthy else "unavailable",
                "engine_failures": getattr(service, "engine_failures", 0),
                "last_engine_error": getattr(service, "last_error", None)}

    async def health(self) -> JSONResponse:
        """`GET /health`: 200 while a request would be served, else 503; engine errors survived so far."""
        health = self._health()
        return JSONResponse(health, 200 if health["status"] == "ok" else 503)

    async def metrics(self) -> Response:
        """`GET /metrics`: Prometheus series of the requests answered and the tokens sampled (`serving.metering`)."""
        content, content_type = self.meter.exposition()
        return Response(content, media_type=content_type)

    async def models(self, episode_id: str | None = None):
        self._episode(episode_id)
        return {"object": "list", "data": [
            {"id": self.served.name, "object": "model", "created": 0, "owned_by": "asyncflow",
             "max_model_len": self.served.max_model_len, "streaming": self._streaming(),
             "status": self._health()["status"]}]}

    def _streaming(self) -> str | None:
        """How `stream: true` is sent: "token" (as sampled), "choice" (each choice once finished), None (no engine)."""
        service = self.served.service
        return None if service is None else "token" if service.streams_tokens else "choice"

    async def _parse(self, request: Request, model: type[BaseModel]):
        """The request's body as `model`, parsed and validated on a worker thread (`parse_request`)."""
        return await asyncio.to_thread(parse_request, await request.body(), model, self.limits)

    async def completions(self, request: Request, episode_id: str | None = None):
        body = await self._parse(request, CompletionRequest)
        self._check_model(body.model)
        self._episode(episode_id, body.n)
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise APIError(400, "prompt: empty", param="prompt")
        if episode_id is not None and len(prompts) > 1:
            raise APIError(400, "one prompt per call within an episode", param="prompt")
        self._check_size(body, len(prompts))
        self._check_chars(sum(len(p) if isinstance(p, str) else 0 for p in prompts), "prompt")

        def prepare():
            rendered = [self._completion_prompt(p, episode_id) for p in prompts]
            return rendered, self._params(body, body.max_tokens, [len(ids) for ids, _ in rendered], episode_id)

        rendered, params = await asyncio.to_thread(prepare)
        return await self._answer(body, rendered, params, "completion", episode_id, body.logprobs is not None)

    async def chat(self, request: Request, episode_id: str | None = None):
        body = await self._parse(request, ChatRequest)
        self._check_model(body.model)
        self._episode(episode_id, body.n)
        self._check_size(body, 1)
        self._check_tools(body)

        def prepare():
            ids, text = self._chat_prompt(body.messages, episode_id, self._rendered_tools(body))
            return ids, text, self._params(body, body.max_completion_tokens or body.max_tokens, [len(ids)], episode_id)

        ids, text, params = await asyncio.to_thread(prepare)
        return await self._answer(body, [(ids, text)], params, "chat", episode_id, body.logprobs)

    async def _answer(self, body: _Sampling, rendered: list[tuple[list[int], str]], params: SamplingParams, kind: str,
                      episode_id: str | None, logprobs: bool):
        """Generate `body.n` choices per rendered (ids, text) prompt: streamed, or as one response."""
        tool_format = self._tool_format(body)
        if body.stream:
            return self._stream(body, rendered, params, kind, episode_id, logprobs=logprobs, tool_format=tool_format)
        results = await self._generate([ids for ids, _ in rendered], params, body.n, episode_id or body.user)

        def respond():
            choices = []
            for p, ((_ids, text), completions) in enumerate(zip(rendered, results)):
                for c, completion in enumerate(completions):
                    out = self._finish(completion, body.stop, episode_id, kind, text, tool_format)
                    choices.append({"index": p * body.n + c, **out})
            return self._respond(body, choices, kind=kind, logprobs=logprobs)

        return await asyncio.to_thread(respond)

    # ------------------------------------------------------------ checks and prompts
    def _check_chars(self, chars: int, param: str) -> None:
        """A prompt's text (chat: as the template rendered it) before tokenising: 400 over `max_prompt_chars`."""
        if chars > self.limits.max_prompt_chars:
            raise APIError(400, f"{param}: {chars} characters is over the limit of {self.limits.max_prompt_chars} "
                           "(limits.max_prompt_chars)", param=param)

    def _check_size(self, body: _Sampling, prompts: int) -> None:
        """The `ServingLimits` a valid request can break before any tokenising: 400 naming the field and the limit
        (the count of stop strings and of messages: `parse_request`, before validation)."""
        limits = self.limits
        if prompts * body.n > limits.max_choices:
            raise APIError(400, f"n: {prompts} prompt(s) x n={body.n} asks for {prompts * body.n} samples, over the "
                           f"limit of {limits.max_choices} (limits.max_choices)", param="n")
        longest = max(map(len, body.stop), default=0)
        if longest > limits.max_stop_chars:
            raise APIError(400, f"stop: a stop string of {longest} characters is over the limit of "
                           f"{limits.max_stop_chars} (limits.max_stop_chars)", param="stop")

    def _check_tools(self, body: ChatRequest) -> None:
        """What pydantic cannot say about `tools` / `tool_choice`: 400 naming the field."""
        names = [tool.function.name for tool in body.tools or []]
        if body.tools is not None and not names:
            raise APIError(400, "tools: an empty list (leave `tools` out for no tools)", param="tools")
        if len(set(names)) != len(names):
            duplicate = next(name for name in names if names.count(name) > 1)
            raise APIError(400, f"tools: the function name {duplicate!r} is given twice", param="tools")
        choice = body.tool_choice
        if choice is not None and choice != "none" and not names:
            raise APIError(400, "tool_choice: only allowed when `tools` are given", param="tool_choice")
        if not isinstance(choice, str) and choice is not None and choice.function.name not in names:
            raise APIError(400, f"tool_choice: names the function {choice.function.name!r}, which is not in `tools` "
                           f"({', '.join(names)})", param="tool_choice")

    def _rendered_tools(self, body: ChatRequest) -> list[dict] | None:
        """The tools handed to the chat template (Hugging Face's shape, which is OpenAI's); None with `tool_choice`
        "none" (the tools are neither rendered nor parsed)."""
        if not body.tools or body.tool_choice_or_default() == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in body.tools]

    def _tool_format(self, body: _Sampling) -> str | None:
        """The tool-call format to parse this request's choices with; None: the text is returned as it is."""
        if not isinstance(body, ChatRequest) or self._rendered_tools(body) is None:
            return None
        return self.served.tool_call_format

    def _check_model(self, model: str) -> None:
        if model != self.served.name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.served.name!r}",
                           param="model", code="model_not_found")

    def _episode(self, episode_id: str | None, n: int = 1) -> None:
        if episode_id is None:
            return
        if not self._recorder(episode_id).is_open(episode_id):
            raise APIError(404, f"episode {episode_id!r} is not open", code="episode_not_found")
        if n != 1:
            raise APIError(400, "n must be 1 within an episode (one sample per call)", param="n")

    def _recorder(self, episode_id: str) -> EpisodeRecorder:
        """The recorder of episodes' calls: 404 for `episode_id` on a server without one (it opens no episode)."""
        if self.recorder is None:
            raise APIError(404, f"episode {episode_id!r} is not open", code="episode_not_found")
        return self.recorder

    def _encode(self, text: str) -> list[int]:
        try:
            return list(self.served.tokenizer(text, add_special_tokens=False)["input_ids"])
        except Exception as err:  # e.g. a character a vocabulary without an unknown token cannot express
            raise APIError(400, f"the text cannot be tokenized: {err}") from None

    def _continued(self, episode_id: str | None, kind: str, text: str) -> list[int] | None:
        """Ids of `text` when it extends the episode's latest context: that context's ids + the new text's."""
        if episode_id is None or self.recorder is None:
            return None
        context = self.recorder.context(episode_id, kind)
        if context is None or not text.startswith(context[1]):
            return None
        return context[0] + self._encode(text[len(context[1]) :])

    def _completion_prompt(self, prompt: str | list[int], episode_id: str | None) -> tuple[list[int], str]:
        tokenizer = self.served.tokenizer
        if not isinstance(prompt, str):
            ids = list(prompt)
            self._check_ids(ids, "prompt")  # before decoding: a tokenizer may raise on ids outside its vocabulary
            return ids, tokenizer.decode(ids, skip_special_tokens=True)
        continued = self._continued(episode_id, "completion", prompt)
        if continued is None:
            bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
            continued = bos + self._encode(prompt)
        self._check_ids(continued, "prompt")
        return continued, prompt

    def _chat_prompt(self, messages: list[ChatMessage], episode_id: str | None,
                     tools: list[dict] | None = None) -> tuple[list[int], str]:
        tokenizer = self.served.tokenizer
        template = self.served.chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise APIError(400, f"model {self.served.name!r} has no chat template: use /v1/completions, or start the "
                           "server with --chat-template FILE", param="messages")
        plain = []
        for m in messages:
            message = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                message["content"] = "".join(part.text for part in m.content)
            plain.append(message)
        if episode_id is not None and self.recorder is not None:
            plain = sampled_turns(plain, functools.partial(self.recorder.tool_turn, episode_id))
        plain = template_messages(plain)

        def render(tools: list[dict] | None) -> str:
            try:
                return tokenizer.apply_chat_template(plain, chat_template=template, tokenize=False,
                                                     add_generation_prompt=True, tools=tools)
            except Exception as err:  # jinja raises its own kinds (a template's raise_exception, a bad field)
                raise APIError(400, f"the chat template failed on these messages: {err}",
                               param="messages") from None

        text = render(tools)
        if tools and text == render(None):  # a template without a `tools` branch would drop them silently
            raise APIError(400, f"tools: the chat template of model {self.served.name!r} does not render tools; "
                           "start the server with --chat-template FILE (one with a `tools` branch), or leave "
                           "`tools` out", param="tools")
        self._check_chars(len(text), "messages")  # every field the template renders counts, not `content` only
        ids = self._continued(episode_id, "chat", text)
        if ids is None:
            ids = self._encode(text)
        self._check_ids(ids, "messages")
        return ids, text

    def _check_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(400, f"{param}: the prompt has no tokens", param=param)
        if min(ids) < 0 or max(ids) >= self.served.vocab_size:
            raise APIError(400, f"{param}: token ids must be in [0, {self.served.vocab_size})", param=param)
        if len(ids) >= self.served.max_model_len:
            raise APIError(400, f"{param}: {len(ids)} tokens leave no room in this model's context of "
                           f"{self.served.max_model_len}", param=param, code="context_length_exceeded")

    def _params(self, body: _Sampling, max_tokens: int | None, prompt_lengths: list[int],
                episode_id: str | None) -> SamplingParams:
        limit = self.served.max_model_len
        longest = max(prompt_lengths)
        if max_tokens is None:
            max_tokens = limit - longest if isinstance(body, ChatRequest) else 16
        forced = self.served.episode_sampling if episode_id is not None else None
        if forced is not None:
            max_tokens = min(max_tokens, forced.max_new_tokens, max(1, limit - longest))
        if longest + max_tokens > limit:
            raise APIError(
                400, f"this model's maximum context length is {limit} tokens; the prompt has {longest} and "
                f"max_tokens asks for {max_tokens} more", param="max_tokens", code="context_length_exceeded")
        tokenizer = self.served.tokenizer
        stop_ids = [i for i in (tokenizer.eos_token_id, *self.served.eos_token_ids) if i is not None]
        for stop in body.stop:  # a stop string that is one token stops the engine itself
            try:
                ids = self._encode(stop)
            except APIError:  # not expressible in this vocabulary: matched in the text only
                continue
            if len(ids) == 1 and tokenizer.decode(ids) == stop:
                stop_ids.append(ids[0])
        if forced is not None:
            return SamplingParams(forced.temperature, forced.top_p, forced.top_k, max_tokens,
                                  tuple(dict.fromkeys([*forced.stop_token_ids, *stop_ids])))
        return SamplingParams(body.temperature, body.top_p, max(body.top_k, 0), max_tokens,
                              tuple(dict.fromkeys(stop_ids)))

    # ------------------------------------------------------------ generation
    def _submit(self, prompts: list[list[int]], params: SamplingParams, n: int, session: str | None,
                on_tokens=None) -> list[Future]:
        """`n` requests per prompt (choice `i` = prompt `i // n`); `on_tokens(choice, ids, logprobs)` if given;
        `session` (the episode, or the request's `user`) keeps a session's requests on one replica
        (`asyncflow.serving.router`)."""
        service = self.served.service
        if service is None:
            raise APIError(503, "no engine is serving right now", type="server_error", code="engine_unavailable")
        futures = []
        try:
            for choice, ids in enumerate(ids for ids in prompts for _ in range(n)):
                callback = None if on_tokens is None else functools.partial(on_tokens, choice)
                futures.append(service.submit(ids, params, on_tokens=callback, session=session))
        except EngineServiceError as err:
            _cancel(futures)
            raise APIError(503, f"the engine is stopped: {err}", type="server_error",
                           code="engine_unavailable") from err
        return futures

    def _timed_out(self) -> APIError:
        return APIError(504, f"generation did not finish within {self.timeout_s:.0f} s", type="timeout_error",
                        code="timeout")

    async def _generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                        session: str | None) -> list[list[Completion]]:
        futures = self._submit(prompts, params, n, session)
        try:
            done = await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(f) for f in futures)), self.timeout_s)
        except asyncio.TimeoutError:
            _cancel(futures)
            raise self._timed_out() from None
        except EngineServiceError as err:
            raise APIError(503, f"the engine failed: {err}", type="server_error",
                           code="engine_unavailable") from err
        return [done[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _finish(self, completion: Completion, stops: list[str], episode_id: str | None, kind: str,
                prompt_text: str, tool_format: str | None = None) -> dict:
        """One choice: the ids up to the first stop string (that string left out of the text), recorded under the
        episode; the context text it leaves is what the agent will send back to continue. With `tool_format`, its
        `turn` is the text parsed into content and tool calls (a tool-calling turn is remembered by the episode
        with the text sampled, so that the agent's sending it back renders that text)."""
        tokenizer = self.served.tokenizer
        ids, logprobs, finish = completion.response_ids, completion.logprobs, completion.finish_reason
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if stops and _stop_at(text, stops) >= 0:
            end = _first_prefix(len(ids), lambda k: _stop_at(tokenizer.decode(ids[:k], skip_special_tokens=True),
                                                             stops) >= 0)
            text = tokenizer.decode(ids[:end], skip_special_tokens=True)
            ids, logprobs, finish, text = ids[:end], logprobs[:end], "stop", text[: _stop_at(text, stops)]
        if episode_id is not None:
            call = CallRecord(list(completion.prompt_ids), list(ids), list(logprobs), completion.weight_version, finish)
            context = prompt_text + tokenizer.decode(ids, skip_special_tokens=kind == "completion")
            try:
                self._recorder(episode_id).record(episode_id, call, kind=kind, text=context)
            except UnknownEpisodeError:
                raise APIError(404, f"episode {episode_id!r} was closed", code="episode_not_found") from None
        turn = ToolTurn(text) if tool_format is None else parse_turn(text, tool_format)
        if turn.tool_calls:
            finish = "tool_calls" if finish == "stop" else finish
            if episode_id is not None:
                try:
                    self._recorder(episode_id).record_tool_turn(episode_id, turn.call_ids, text, turn)
                except UnknownEpisodeError:
                    raise APIError(404, f"episode {episode_id!r} was closed", code="episode_not_found") from None
        self.meter.choice(len(completion.prompt_ids), len(ids), finish, completion.weight_version,
                         completion.cached_prompt_tokens)
        return {"text": text, "turn": turn, "finish_reason": finish, "token_ids": list(ids),
                "token_logprobs": list(logprobs), "prompt_token_ids": list(completion.prompt_ids),
                "weight_version": completion.weight_version}

    # ------------------------------------------------------------ responses
    def _text_offsets(self, ids: list[int]) -> list[int]:
        """Where each token's share of the decoded text starts (the shares join to the whole text)."""
        offsets, at, before = [], 0, ""
        for end in range(1, len(ids) + 1):
            offsets.append(at)
            now = self.served.tokenizer.decode(ids[:end], skip_special_tokens=True)
            at += len(now) - len(before) if now.startswith(before) else len(now)
            before = now
        return offsets

    def _logprobs(self, kind: str, ids: list[int], logprobs: list[float]) -> dict:
        tokens = [self.served.tokenizer.decode([i]) for i in ids]
        if kind == "chat":
            entries = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in zip(tokens, logprobs)]
            return {"content": [{**entry, "top_logprobs": [entry]} for entry in entries]}
        return {"tokens": tokens, "token_logprobs": list(logprobs),
                "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs)], "text_offset": self._text_offsets(ids)}

    def _envelope(self, kind: str, object_name: str) -> dict:
        """The fields every response (and every chunk of one stream) starts with."""
        return {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}", "object": object_name,
                "created": int(time.time()), "model": self.served.name}

    def _respond(self, body: _Sampling, choices: list[dict], *, kind: str, logprobs: bool):
        prompt_tokens = sum(len(c["prompt_token_ids"]) for c in choices[:: body.n])
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": sum(len(c["token_ids"]) for c in choices)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        out = []
        for c in choices:
            ids, lps = c["token_ids"], c["token_logprobs"]
            choice = {"index": c["index"], "finish_reason": c["finish_reason"],
                      "logprobs": self._logprobs(kind, ids, lps) if logprobs else None,
                      **{k: c[k] for k in ("token_ids", "token_logprobs", "prompt_token_ids", "weight_version")}}
            if kind == "chat":
                turn = c["turn"]
                choice["message"] = {"role": "assistant", "content": turn.content}
                if turn.tool_calls:
                    choice["message"]["tool_calls"] = turn.tool_calls
            else:
                choice["text"] = c["text"]
            out.append(choice)
        object_name = "chat.completion" if kind == "chat" else "text_completion"
        return {**self._envelope(kind, object_name), "choices": out, "usage": usage}

    def _stream(self, body: _Sampling, rendered: list[tuple[list[int], str]], params: SamplingParams, kind: str,
                episode_id: str | None, *, logprobs: bool, tool_format: str | None = None) -> StreamingResponse:
        """Submit every choice with a token callback and stream its pieces as they come (module docstring)."""
        loop = asyncio.get_running_loop()
        arrivals: asyncio.Queue = asyncio.Queue()
        abandoned = False  # the stream ended (finished, failed or its client went away): drop late tokens

        def on_tokens(choice: int, ids: list[int], lps: list[float]) -> None:  # on the engine's thread
            if not abandoned:
                loop.call_soon_threadsafe(arrivals.put_nowait, (choice, ids, lps))

        def on_done(choice: int, future: Future) -> None:  # on the engine's thread
            if not abandoned:
                loop.call_soon_threadsafe(arrivals.put_nowait, (choice, future, None))

        futures = self._submit([ids for ids, _ in rendered], params, body.n, episode_id or body.user, on_tokens)
        for choice, future in enumerate(futures):
            future.add_done_callback(functools.partial(on_done, choice))
        if self._streaming() == "choice" and not self.told_choice_streaming:
            self.told_choice_streaming = True
            log.warning("this engine cannot stream tokens: a streamed choice is sent once it has finished")
        envelope = self._envelope(kind, "chat.completion.chunk" if kind == "chat" else "text_completion")

        def event(choices: list[dict], **extra) -> str:
            return f"data: {json.dumps({**envelope, 'choices': choices, **extra})}\n\n"

        def piece(index: int, text: str, ids: list[int], lps: list[float], finish: str | None = None,
                  tool_calls: list[dict] | None = None, **extra) -> str:
            body_part: dict[str, Any]
            if kind == "chat":
                delta: dict[str, Any] = {"content": text} if text else {}
                if tool_calls:  # each call whole, in one delta (OpenAI's shape allows its arguments in pieces)
                    delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
                body_part = {"delta": delta}
            else:
                body_part = {"text": text}
            return event([{"index": index, **body_part, "finish_reason": finish, "token_ids": ids,
                           "token_logprobs": lps, "logprobs": self._logprobs(kind, ids, lps) if logprobs else None,
                           **extra}])

        async def events():
            nonlocal abandoned
            hold_from = None if tool_format is None else TOOL_CALL_FORMATS[tool_format].opening
            streams = [TextStream(self.served.tokenizer, body.stop, hold_from) for _ in futures]
            usage = {"prompt_tokens": sum(len(ids) for ids, _ in rendered), "completion_tokens": 0}
            deadline = loop.time() + self.timeout_s
            try:
                if kind == "chat":
                    for index in range(len(futures)):
                        yield event([{"index": index, "delta": {"role": "assistant", "content": ""},
                                      "finish_reason": None}])
                unfinished = len(futures)
                while unfinished:
                    try:
                        arrived = [await asyncio.wait_for(arrivals.get(), max(deadline - loop.time(), 0))]
                    except asyncio.TimeoutError:
                        raise self._timed_out() from None
                    while not arrivals.empty():  # what came meanwhile goes out merged: one chunk per choice
                        arrived.append(arrivals.get_nowait())
                    waiting: dict[int, tuple[str, list[int], list[float]]] = {}  # by choice, in arrival order
                    for index, item, lps in arrived:
                        text, ids, lps_before = waiting.pop(index, ("", [], []))
                        if lps is not None:  # tokens
                            more_text, more_ids, more_lps = streams[index].add(item, lps)
                            waiting[index] = (text + more_text, ids + more_ids, lps_before + more_lps)
                            continue
                        unfinished -= 1
                        try:
                            completion = item.result()
                        except EngineServiceError as err:
                            raise APIError(503, f"the engine failed: {err}", type="server_error",
                                           code="engine_unavailable") from None
                        out = self._finish(completion, body.stop, episode_id, kind, rendered[index // body.n][1],
                                           tool_format)
                        sent = len(streams[index].ids)
                        usage["completion_tokens"] += len(out["token_ids"])
                        turn = out["turn"]
                        yield piece(index, text + streams[index].rest(turn.content or ""),
                                    ids + out["token_ids"][sent:], lps_before + out["token_logprobs"][sent:],
                                    out["finish_reason"], turn.tool_calls, prompt_token_ids=out["prompt_token_ids"],
                                    weight_version=out["weight_version"])
                    for index, (text, ids, lps) in waiting.items():
                        if ids or text:
                            yield piece(index, text, ids, lps)
                if (body.stream_options or {}).get("include_usage"):
                    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                    yield event([], usage=usage)
                yield "data: [DONE]\n\n"
            except APIError as err:
                yield f"data: {json.dumps(err.body)}\n\n"
            except Exception as err:  # a bug here: end the stream in OpenAI's shape, not as a cut connection
                log.exception("a streamed response failed")
                yield f"data: {json.dumps(error_body(f'internal error: {err!r}', type='server_error'))}\n\n"
            finally:
                abandoned = True
                _cancel(futures)

        return StreamingResponse(events(), media_type="text/event-stream")


def _stop_at(text: str, stops: list[str], start: int = 0) -> int:
    """Where the first stop string in `text[start:]` begins, -1 if none (str.find: linear in the text)."""
    return min((at for at in (text.find(s, start) for s in stops) if at >= 0), default=-1)


def _first_prefix(n: int, holds) -> int:
    """The smallest k in 1..n with `holds(k)`, for a `holds` false then true as k grows (`holds(n)` is true):
    O(log n) calls, e.g. the fewest tokens whose text contains a stop string."""
    low, high = 1, n
    while low < high:
        middle = (low + high) // 2
        if holds(middle):
            high = middle
        else:
            low = middle + 1
    return high


def _cancel(futures: list[Future]) -> None:
    """Withdraw requests not taken by the engine yet (one in flight runs to its end; its result is dropped)."""
    for future in futures:
        future.cancel()


class TextStream:
    """One streamed choice's text as its tokens arrive: pieces that are never taken back, cut at a stop string.

    `ids` are the tokens sent so far (up to the one that completed a stop string); `add` returns what may be sent
    now; `rest(final_text)` what remains of the choice's final text. The text grows by incremental decoding (as
    in vLLM): each new token's text is `decode(ids[prefix:])` minus `decode(ids[prefix:read])`, a window of the
    last few tokens as context, so a token costs a decode of a few tokens (the whole text would cost O(n) per
    token) and a decoder that strips or merges at a window's start (sentencepiece's leading space) does so
    on both sides alike; the window moves on only once its text decodes cleanly (no U+FFFD). What is held back
    is described in the module docstring.
    """

    def __init__(self, tokenizer, stops: list[str], hold_from: str | None = None):
        self.tokenizer = tokenizer
        self.stops = stops
        self.hold_from = hold_from  # text from its first occurrence on is held (a tool call: parsed once whole)
        self.ids: list[int] = []
        self.stopped = False
        self._text = ""  # decoded text of ids[:read]
        self._prefix = self._read = 0
        self._sent = ""

    def add(self, ids: list[int], logprobs: list[float]) -> tuple[str, list[int], list[float]]:
        """Take a step's tokens -> (text to send now, the ids and log-probs taken: none after a stop string)."""
        if not ids or self.stopped:
            return "", [], []
        taken = 0
        longest = max(map(len, self.stops), default=0)
        while taken < len(ids) and not self.stopped:
            self.ids.append(ids[taken])
            taken += 1
            settled = len(self._text)  # a stop string not found before now can only end in the text added after
            pending = self._pending_text()
            text = self._text + pending
            cut = _stop_at(text, self.stops, max(0, settled - longest))
            if cut >= 0:
                self.stopped, self._text = True, text[:cut]
        return self.rest(self._held(self._text) if self.stopped else self._safe(pending)), ids[:taken], logprobs[:taken]

    def _held(self, text: str) -> str:
        """`text` up to `hold_from`, if it holds one."""
        at = text.find(self.hold_from) if self.hold_from else -1
        return text if at < 0 else text[:at]

    def _pending_text(self) -> str:
        """The text of the ids after `read` (moving the window on when it decodes cleanly)."""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
        context = decode(self.ids[self._prefix : self._read])
        window = decode(self.ids[self._prefix :])
        if len(window) <= len(context) or window.endswith("\ufffd"):
            return window[len(context) :]  # part of a character, or nothing visible yet: keep the window
        self._text += window[len(context) :]
        self._prefix, self._read = self._read, len(self.ids)
        return ""

    def _safe(self, pending: str) -> str:
        """The text so far (`pending`: the window's unsettled part) less what must be held back."""
        # U+FFFD: the end of a multi-byte character is due
        text = self._held(self._text + pending).rstrip("\ufffd").rstrip()
        held = [*self.stops, self.hold_from] if self.hold_from else self.stops
        hold = max((k for s in held for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return text[: len(text) - hold]

    def rest(self, text: str) -> str:
        """What of `text` (the text so far, or the choice's final text) has not been sent yet; it now has."""
        if self._sent.startswith(text):  # nothing new (or more held back than before)
            return ""
        if not text.startswith(self._sent):
            log.warning("this tokenizer's decode of more tokens changed text already streamed (%r -> %r)",
                        self._sent, text)
            return ""
        new, self._sent = text[len(self._sent) :], text
        return new
