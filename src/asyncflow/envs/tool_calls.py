"""The tool-call format and its parser: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The format of the Hermes and Qwen chat templates: a model turn may hold one or more such blocks, each
a JSON object with a string `name` and an object `arguments`. Text outside the blocks is free.

Invariants: `parse_tool_calls` never raises on model text; it returns the calls, or a `ToolCallError`
whose message is meant for the model (it becomes the observation), e.g. an unclosed tag or bad JSON.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
MAX_CALLS_PER_TURN = 8


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolCallError:
    message: str


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text a model writes to call `name` (compact JSON, as demonstrations use it)."""
    payload = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    return f"{OPEN}{payload}{CLOSE}"


def parse_tool_calls(text: str) -> list[ToolCall] | ToolCallError:
    """The calls in one model turn (empty: no call, the turn is a final answer), or what is malformed."""
    blocks = _BLOCK.findall(text)
    if text.count(OPEN) != len(blocks) or text.count(CLOSE) != len(blocks):
        return ToolCallError(f"malformed tool call: every {OPEN} needs one {CLOSE}")
    if len(blocks) > MAX_CALLS_PER_TURN:
        return ToolCallError(f"too many tool calls in one turn ({len(blocks)} > {MAX_CALLS_PER_TURN})")
    calls = []
    for block in blocks:
        try:
            payload = json.loads(block)
        except json.JSONDecodeError as err:
            return ToolCallError(f"malformed tool call: invalid JSON ({err.msg} at {err.pos})")
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return ToolCallError('malformed tool call: expected {"name": <string>, "arguments": {...}}')
        arguments = payload.get("arguments", {})
        if not isinstance(arguments, dict):
            return ToolCallError("malformed tool call: arguments must be a JSON object")
        calls.append(ToolCall(payload["name"], arguments))
    return calls
