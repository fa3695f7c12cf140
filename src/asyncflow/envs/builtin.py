"""The built-in environments: a model that calls tools, then gives a final answer scored by a verifier.

Owns: `ToolEnv` and its registrations: `calculator` (the calculator tool only) and `tools` (calculator and
sandboxed Python).

An episode of `ToolEnv`: each model turn holding `<tool_call>` blocks is answered with the tools' outputs
(one observation per turn: the calls' outputs joined by newlines); a malformed
call or an unknown tool is answered with an error message (the episode goes on); the first turn without a
call is the final answer, scored by `verifier(final_text, row)`.

Invariant: `step` never raises for model text; every tool call goes through the `ToolBox` (limits, counts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncflow.envs.base import StepResult, register_environment
from asyncflow.envs.tool_calls import ToolCallError, format_tool_call, parse_tool_calls
from asyncflow.envs.tools import ToolBox

Verifier = Callable[[str, dict[str, Any]], float]
COUNTERS = ("tool_calls", "tool_errors", "tool_timeouts", "malformed_calls")


class ToolEnv:
    """See the module docstring. `tools`: the names of `toolbox`'s tools this environment offers."""

    def __init__(self, *, toolbox: ToolBox, verifier: Verifier, tools: tuple[str, ...] | None = None):
        self.toolbox = toolbox
        self.verifier = verifier
        self.tools = tuple(toolbox.tools) if tools is None else tools
        self.reset({})

    def reset(self, row: dict[str, Any]) -> None:
        self.row = row
        self.counts = dict.fromkeys(COUNTERS, 0)

    def step(self, model_text: str) -> StepResult:
        calls = parse_tool_calls(model_text)
        if isinstance(calls, ToolCallError):
            self.counts["malformed_calls"] += 1
            return StepResult(observation=f"error: {calls.message}", info=dict(self.counts))
        if not calls:
            return StepResult(reward=float(self.verifier(model_text, self.row)), done=True, info=dict(self.counts))
        outputs = []
        for call in calls:
            self.counts["tool_calls"] += 1
            if call.name not in self.tools:
                self.counts["tool_errors"] += 1
                outputs.append(f"error: unknown tool {call.name!r} (tools: {', '.join(self.tools)})")
                continue
            result = self.toolbox.call(call.name, call.arguments)
            self.counts["tool_errors"] += result.error
            self.counts["tool_timeouts"] += result.timeout
            outputs.append(result.text)
        return StepResult(observation="\n".join(outputs), info=dict(self.counts))

    def demonstration(self, row: dict[str, Any]) -> list[str] | None:
        """The model turns of a solved episode, for SFT on tool-use demonstrations: for a row with an
        `expression` (the `tool_arithmetic` task), one calculator call, then the answer; else None."""
        if "expression" not in row or "calculator" not in self.tools:
            return None
        return [format_tool_call("calculator", {"expression": row["expression"]}), str(row["answer"])]


@register_environment("calculator")
def calculator_env(*, toolbox: ToolBox, verifier: Verifier) -> ToolEnv:
    return ToolEnv(toolbox=toolbox, verifier=verifier, tools=("calculator",))


@register_environment("tools")
def tools_env(*, toolbox: ToolBox, verifier: Verifier) -> ToolEnv:
    return ToolEnv(toolbox=toolbox, verifier=verifier, tools=("calculator", "python"))
