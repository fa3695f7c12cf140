"""The tool-call format and its parser: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The format of the Hermes and Qwen chat templates: a model turn may hold one or more such blocks, each
a JSON object with a string `name` and an object `arguments`. Text outside the blocks is free.

Invariants: `parse_tool_calls` never raises on model text and runs in time linear in its length (one scan for
the tags; JSON of a bounded size); it returns the calls, or a `ToolCallError` whose message is meant for the
model (it becomes the observation), e.g. an unclosed tag, bad or too deeply nested JSON, a number too long.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALLS_PER_TURN = 8
MAX_CALL_CHARS = 16_384  # one call's JSON


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


def tool_call_blocks(text: str) -> list[str] | ToolCallError:
    """The JSON text of each `<tool_call>...</tool_call>` block, in one pass over `text`."""
    blocks: list[str] = []
    position = 0
    while (start := text.find(OPEN, position)) != -1:
        end = text.find(CLOSE, start + len(OPEN))
        block = text[start + len(OPEN): end] if end != -1 else ""
        if end == -1 or OPEN in block:
            return ToolCallError(f"malformed tool call: every {OPEN} needs one {CLOSE}")
        blocks.append(block)
        if len(blocks) > MAX_CALLS_PER_TURN:
            return ToolCallError(f"too many tool calls in one turn (> {MAX_CALLS_PER_TURN})")
        position = end + len(CLOSE)
    if text.count(CLOSE) != len(blocks):
        return ToolCallError(f"malformed tool call: every {CLOSE} needs one {OPEN}")
    return blocks


def parse_tool_calls(text: str) -> list[ToolCall] | ToolCallError:
    """The calls in one model turn (empty: no call, the turn is a final answer), or what is malformed."""
    blocks = tool_call_blocks(text)
    if isinstance(blocks, ToolCallError):
        return blocks
    calls = []
    for block in blocks:
        if len(block) > MAX_CALL_CHARS:
            return ToolCallError(f"malformed tool call: longer than {MAX_CALL_CHARS} characters")
        try:
            payload = json.loads(block)
        except json.JSONDecodeError as err:
            return ToolCallError(f"malformed tool call: invalid JSON ({err.msg} at {err.pos})")
        except (RecursionError, ValueError):  # nesting too deep; an integer over Python's digit limit
            return ToolCallError("malformed tool call: JSON nested too deeply or a number too long")
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return ToolCallError('malformed tool call: expected {"name": <string>, "arguments": {...}}')
        arguments = payload.get("arguments", {})
        if not isinstance(arguments, dict):
            return ToolCallError("malformed tool call: arguments must be a JSON object")
        calls.append(ToolCall(payload["name"], arguments))
    return calls
