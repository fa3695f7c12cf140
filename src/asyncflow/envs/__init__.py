"""Multi-turn environments and the tools they call. Imports nothing of asyncflow outside this package.

`base` (the `Environment` protocol, `StepResult`, the registry), `tool_calls` (the
`<tool_call>{json}</tool_call>` format and its parser), `tools` (the calculator, the sandboxed Python
tool, `ToolBox` with timeouts and counts), `builtin` (`ToolEnv` and the built-in environments).
"""

from asyncflow.envs.base import ENVIRONMENTS, Environment, StepResult, make_environment, register_environment
from asyncflow.envs.builtin import ToolEnv
from asyncflow.envs.tool_calls import ToolCall, ToolCallError, format_tool_call, parse_tool_calls
from asyncflow.envs.tools import TOOLS, SandboxLimits, ToolBox, ToolResult, calculator, run_python

__all__ = [
    "ENVIRONMENTS", "Environment", "SandboxLimits", "StepResult", "TOOLS", "ToolBox", "ToolCall", "ToolCallError",
    "ToolEnv", "ToolResult", "calculator", "format_tool_call", "make_environment", "parse_tool_calls",
    "register_environment", "run_python",
]
