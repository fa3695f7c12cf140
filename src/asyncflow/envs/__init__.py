"""Multi-turn environments and the tools they call. Imports nothing of asyncflow outside this package.

`base` (the `Environment` protocol, `StepResult`, the registry), `tool_calls` (the
`<tool_call>{json}</tool_call>` format and its parser), `tools` (the calculator, `ToolBox` with timeouts and
counts), `sandbox` (the Python tool: bubblewrap, seccomp, rlimits), `builtin` (`ToolEnv` and the built-in
environments).
"""

from asyncflow.envs.base import ENVIRONMENTS, Environment, StepResult, make_environment, register_environment
from asyncflow.envs.builtin import ToolEnv
from asyncflow.envs.sandbox import SandboxLimits, run_python
from asyncflow.envs.tool_calls import ToolCall, ToolCallError, format_tool_call, parse_tool_calls
from asyncflow.envs.tools import TOOLS, ToolBox, ToolResult, calculator

__all__ = [
    "ENVIRONMENTS", "Environment", "SandboxLimits", "StepResult", "TOOLS", "ToolBox", "ToolCall", "ToolCallError",
    "ToolEnv", "ToolResult", "calculator", "format_tool_call", "make_environment", "parse_tool_calls",
    "register_environment", "run_python",
]
