"""The text a byte-level BPE tokenizer for the built-in tasks is trained on.

Owns: `tokenizer_corpus` (lines drawn from every built-in task's train stream at every difficulty, in the
forms a model meets them: plain `prompt` + answer, the chat roles' text, tool calls in the Hermes format
and their results) and `CORPUS_FILE`, where `python -m asyncflow.data.corpus` writes it for the model presets
(`asyncflow.models.bpe` reads the file: the models layer does not import the data layer).

Invariant: deterministic; the same code gives the same lines in every process, so the committed file can be
checked against it (tests/models/test_bpe_presets.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from asyncflow.data.tasks import TASKS, make_task

CORPUS_FILE = Path(__file__).resolve().parents[1] / "models" / "bpe_corpus.txt"
EXAMPLES_PER_LEVEL = 60
# the fixed text of the chat template and the tool environments, so that their words get merges of their own
FIXED_TEXT = (
    "You are a helpful assistant.",
    "# Tools",
    "You may call one or more functions to assist with the user query.",
    "You are provided with function signatures within <tools></tools> XML tags:",
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:",
    '{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.", '
    '"parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}',
    '{"type": "function", "function": {"name": "python", "description": "Run Python code and return its output.", '
    '"parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}',
    "system", "user", "assistant", "tool", "<tool_response>", "</tool_response>",
    "error: malformed tool call", "error: unknown tool",
)


def _tool_call(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}, separators=(",", ":")) + "</tool_call>"


def tokenizer_corpus(examples_per_level: int = EXAMPLES_PER_LEVEL) -> list[str]:
    """The corpus, one text per line (no line holds a newline): see the module docstring."""
    lines = list(FIXED_TEXT)
    for name in sorted(TASKS):
        task_class = TASKS[name]
        for difficulty in sorted(task_class.levels):
            for example in make_task(name, difficulty).examples("train", examples_per_level):
                answer = example.answer
                if name == "countdown":
                    answer = example.metadata["solution"]  # the text a model writes; the ground truth is JSON
                lines.append(example.prompt + answer)
                lines.append(answer)
                if "expression" in example.metadata:
                    expression = example.metadata["expression"]
                    lines.append(_tool_call("calculator", {"expression": expression}))
                    lines.append(json.dumps({"name": "calculator", "arguments": {"expression": expression}}))
    return lines


if __name__ == "__main__":
    text = "\n".join(tokenizer_corpus()) + "\n"
    if sys.argv[1:] == ["--check"]:
        sys.exit(0 if CORPUS_FILE.read_text() == text else f"{CORPUS_FILE} is out of date")
    CORPUS_FILE.write_text(text)
