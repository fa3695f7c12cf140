"""Built-in tools and `ToolBox`, which runs tool calls with limits.

Owns: `calculator` (exact arithmetic on a parsed expression tree: nothing is evaluated as code), `TOOLS` (name ->
tool: the calculator and `run_python`, Python in the sandbox of `asyncflow.envs.sandbox`) and `ToolBox`.

Invariants:
- A tool call never raises out of `ToolBox.call`: an exception, a timeout or a flood becomes a
  `ToolResult` with `error` / `timeout` set and a message for the model; observations are cut to
  `max_output_chars`.
- Every call is bounded by `timeout_s` (an in-process tool that hangs keeps its pool thread, and counts
  as a timeout; the Python tool's child is killed).
"""

from __future__ import annotations

import ast
import operator
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from asyncflow.envs.sandbox import SandboxLimits, ToolLimitError, run_python

MAX_EXPRESSION_CHARS = 200
MAX_POWER = 64  # exponents beyond this are refused: 9**9**9 would hang a calculator that evaluates it
MAX_BITS = 4096  # numerators and denominators beyond this are refused, before a power computes them


class CalculatorError(ValueError):
    pass


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def _bits(value: Fraction) -> int:
    return max(value.numerator.bit_length(), value.denominator.bit_length())


def _bounded(value: Fraction) -> Fraction:
    if _bits(value) > MAX_BITS:
        raise CalculatorError(f"number too large (over {MAX_BITS} bits)")
    return value


def _power(a: Fraction, b: Fraction) -> Fraction:
    if b.denominator != 1 or abs(b) > MAX_POWER:
        raise CalculatorError(f"exponent must be an integer in [-{MAX_POWER}, {MAX_POWER}]")
    if _bits(a) * abs(int(b)) > MAX_BITS:  # checked before computing: the power itself would hold the GIL
        raise CalculatorError(f"number too large (over {MAX_BITS} bits)")
    return a ** int(b)


def calculator(expression: str) -> str:
    """Evaluate `+ - * / // % **` and parentheses over integers and decimals, exactly (fractions); integers
    print as integers, other values as decimals (12 significant digits)."""
    if not isinstance(expression, str):
        raise CalculatorError("expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError(f"cannot parse {expression!r}") from None

    def visit(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return visit(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = visit(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            return _power(visit(node.left), visit(node.right))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = visit(node.left), visit(node.right)
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
                raise CalculatorError("division by zero")
            return _bounded(_BINARY[type(node.op)](left, right))  # inputs bounded: each operation is cheap
        raise CalculatorError(f"unsupported expression element {type(node).__name__}")

    value = visit(tree)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.12g}"


TOOLS: dict[str, Callable[..., str]] = {"calculator": calculator, "python": run_python}


@dataclass(frozen=True)
class ToolResult:
    text: str
    error: bool = False
    timeout: bool = False


class ToolBox:
    """The tools an environment may call, run on a thread pool with a per-call timeout; thread-safe.

    `tools`: name -> function taking the call's arguments as keywords and returning text (the `python` tool
    takes `code` and runs with `limits`)."""

    def __init__(self, tools: dict[str, Callable[..., str]] | None = None, *, timeout_s: float = 5.0,
                 max_output_chars: int = 1024, workers: int = 8, limits: SandboxLimits | None = None):
        self.tools = dict(TOOLS if tools is None else tools)
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.limits = limits or SandboxLimits(timeout_s=timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tool")

    def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        if name not in self.tools:
            return ToolResult(f"error: unknown tool {name!r} (tools: {', '.join(sorted(self.tools))})", error=True)
        tool = self.tools[name]
        if tool is run_python:
            arguments = {**arguments, "limits": self.limits}
        try:
            text = self._pool.submit(tool, **arguments).result(timeout=self.timeout_s + 1.0)
        except (FutureTimeout, TimeoutError, subprocess.TimeoutExpired):
            return ToolResult(f"error: {name} timed out after {self.timeout_s:g} s", error=True, timeout=True)
        except Exception as err:  # noqa: BLE001 -- any failure of a tool is an observation for the model
            message = str(err) if isinstance(err, (ToolLimitError, CalculatorError)) else f"{type(err).__name__}: {err}"
            return ToolResult(f"error: {message}"[: self.max_output_chars], error=True)
        text = str(text)
        if len(text) > self.max_output_chars:
            text = text[: self.max_output_chars] + "...[truncated]"
        return ToolResult(text)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
