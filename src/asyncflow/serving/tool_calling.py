"""OpenAI tool calling for the chat completions route: the `tools` / `tool_choice` request fields, how messages that
carry tool calls are handed to the chat template, and the model's tool calls parsed out of its text.

Owns: `Tool` / `NamedToolChoice` (the request models), `TOOL_CALL_FORMATS` (format name -> parser of a model turn),
`ToolTurn` (one parsed assistant turn: the text outside the calls and the calls in OpenAI's shape, with ids),
`template_messages` (OpenAI messages -> what Hugging Face chat templates take) and `sampled_turns` (the assistant
turns an episode's model sampled, rendered back as their exact text).

Invariants:
- Parsing never raises on model text: a turn whose calls are malformed is plain text (`ToolTurn.tool_calls` empty,
  `content` the whole text), so a bad call reaches the client as content, never as a 500.
- `content` is the text outside the call blocks, in order (None when only whitespace is left); the calls keep the
  order the model wrote them in, each with a fresh id `call_<hex>` and its `arguments` as compact JSON text.
- Hugging Face templates get an assistant call's `arguments` as a JSON object (what they `tojson`), not OpenAI's
  JSON string; a string that is not a JSON object is handed on unchanged.
- Within an episode, an assistant message whose tool calls are, by id, name, arguments and content, the ones this
  server returned for a sampled turn is handed to the template as that turn's text (`content`, no `tool_calls`):
  the template renders the text the model sampled, so the prompt extends the recorded context and the sampled ids
  are reused as they are (`serving.episodes`). A message the agent changed is rendered by the template as given.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from asyncflow.envs.tool_calls import CLOSE, OPEN, ToolCall, ToolCallError, parse_tool_calls


# ---------------------------------------------------------------- request fields
class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """One entry of `tools`: `{"type": "function", "function": {"name", "description", "parameters"}}`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class _FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming one function: `{"type": "function", "function": {"name": ...}}`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: _FunctionName


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


# ---------------------------------------------------------------- formats
@dataclass(frozen=True)
class ToolCallFormat:
    """How one model family writes a tool call: `parse(text)` -> its calls, or a `ToolCallError`;
    `opening`: the text a call starts with (a stream holds the text back from there until the turn is parsed)."""

    parse: Callable[[str], list[ToolCall] | ToolCallError]
    opening: str
    strip: Callable[[str], str]
    """`text` less its call blocks (called only on text whose calls parsed)."""


def _strip_tagged(text: str) -> str:
    pieces, position = [], 0
    while (start := text.find(OPEN, position)) != -1:
        pieces.append(text[position:start])
        position = text.find(CLOSE, start) + len(CLOSE)
    pieces.append(text[position:])
    return "".join(pieces)


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    # Hermes / Qwen2 / Qwen2.5 / Qwen3 templates: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.
    "hermes": ToolCallFormat(parse=parse_tool_calls, opening=OPEN, strip=_strip_tagged),
}


@dataclass
class ToolTurn:
    """An assistant turn in OpenAI's shape: `content` (None: nothing outside the calls) and `tool_calls`."""

    content: str | None
    tool_calls: list[dict] = field(default_factory=list)

    @property
    def call_ids(self) -> tuple[str, ...]:
        return tuple(call["id"] for call in self.tool_calls)


def parse_turn(text: str, format_name: str) -> ToolTurn:
    """The model's text -> its turn; text whose calls are malformed, or that has none, is all content."""
    tool_format = TOOL_CALL_FORMATS[format_name]
    calls = tool_format.parse(text)
    if isinstance(calls, ToolCallError) or not calls:
        return ToolTurn(text)
    outside = tool_format.strip(text)
    return ToolTurn(outside if outside.strip() else None, [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
         "function": {"name": call.name, "arguments": json.dumps(call.arguments, separators=(",", ":"))}}
        for call in calls])


# ---------------------------------------------------------------- messages for the template
def _arguments_object(arguments: Any) -> Any:
    if not isinstance(arguments, str):
        return arguments
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages (plain dicts) -> what Hugging Face templates take: each assistant call's `arguments`
    as a JSON object (module docstring). The input is not changed."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            message = {**message, "tool_calls": [
                {**call, "function": {**call["function"], "arguments": _arguments_object(
                    call["function"].get("arguments"))}}
                if isinstance(call, dict) and isinstance(call.get("function"), dict) else call
                for call in calls]}
        out.append(message)
    return out


def _same_calls(given: list, returned: list[dict]) -> bool:
    """`given` (a message's `tool_calls`) names the calls `returned`, with the same arguments (as JSON values)."""
    if not isinstance(given, list) or len(given) != len(returned):
        return False
    for call, ours in zip(given, returned):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("id") != ours["id"]:
            return False
        if function.get("name") != ours["function"]["name"]:
            return False
        if _arguments_object(function.get("arguments")) != json.loads(ours["function"]["arguments"]):
            return False
    return True


def sampled_turns(messages: list[dict], lookup: Callable[[tuple[str, ...]], tuple[str, ToolTurn] | None]
                  ) -> list[dict]:
    """`messages` with each assistant message that repeats a turn this server returned (`lookup(call ids)` -> (the
    text the model sampled, the turn returned), None if unknown) replaced by that text as plain content."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list) and calls:
            ids = tuple(call["id"] for call in calls if isinstance(call, dict) and isinstance(call.get("id"), str))
            known = lookup(ids) if len(ids) == len(calls) else None
            if known is not None:
                text, turn = known
                if _same_calls(calls, turn.tool_calls) and (message.get("content") or None) == turn.content:
                    message = {key: value for key, value in message.items() if key != "tool_calls"}
                    message["content"] = text
        out.append(message)
    return out
