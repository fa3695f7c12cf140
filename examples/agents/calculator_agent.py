"""An agent using plain `openai` function calling, trained by `asyncflow train examples/tool_agent_grpo.yaml`.

It offers the model one tool, `calculator`, with `tool_choice="auto"`; when the reply has `tool_calls` it runs each
call with a safe arithmetic evaluator, sends the assistant message back with one `role: "tool"` message per call
(`tool_call_id`), asks again, and returns the last reply's text as its final answer (scored by the run's reward
functions: `exact_match` in `examples/tool_agent_grpo.yaml`). The same function runs unchanged against `asyncflow
serve` or any OpenAI-compatible endpoint; it asks for greedy decoding (a training run samples its episodes with
`rollout.temperature` whatever the agent asks).
"""

from __future__ import annotations

import ast
import json
import operator

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of integers with + - * and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}
TOOLS = [CALCULATOR]
MAX_TURNS = 3  # model calls per episode: a call, then the answer, with one spare
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """The value of an integer expression (`+ - *`, parentheses, unary minus) as text, or an error message for the
    model; nothing is run as code (the expression is walked as a syntax tree, operands at most 12 digits)."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) < 10**12:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only integers, + - * and parentheses")

    try:
        return str(value(ast.parse(str(expression)[:200], mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as err:
        return f"error: {err}"


def run_call(call) -> str:
    """One tool call's result text: the calculator's, or an error naming what was wrong."""
    if call.function.name != "calculator":
        return f"error: unknown tool {call.function.name!r}"
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return "error: arguments are not JSON"
    if not isinstance(arguments, dict) or "expression" not in arguments:
        return "error: expected {\"expression\": ...}"
    return calculate(arguments["expression"])


def solve(client, row) -> str:
    """Ask with the calculator offered until a reply has no tool call (at most `MAX_TURNS` calls); returns that
    reply's text ("" when the turns ran out)."""
    messages: list[dict] = [{"role": "user", "content": row.prompt}]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model=row.model, messages=messages, tools=TOOLS, tool_choice="auto",
                                               temperature=0, max_tokens=24).choices[0].message
        if not reply.tool_calls:
            return reply.content or ""
        messages.append(reply.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": call.id, "content": run_call(call)} for call in reply.tool_calls]
    return ""


solve.tools = TOOLS  # type: ignore[attr-defined]  # the run renders SFT and evaluation prompts with them
