"""Tools, the sandbox and the tool-call parser, as a rollout uses them (real subprocesses, no mocks)."""

from __future__ import annotations

import re
import time

import pytest

from asyncflow.envs import (
    SandboxLimits,
    ToolBox,
    ToolCall,
    ToolCallError,
    ToolEnv,
    calculator,
    make_environment,
    parse_tool_calls,
)
from asyncflow.envs.base import EnvironmentSpecError
from asyncflow.envs.tool_calls import format_tool_call

FAST = SandboxLimits(timeout_s=5.0, cpu_s=1, memory_mb=128, max_output_bytes=1024)


@pytest.fixture(scope="module")
def toolbox():
    box = ToolBox(timeout_s=5.0, limits=FAST)
    yield box
    box.close()


def test_calculator_is_exact_and_evaluates_no_code():
    assert calculator("37*48+215") == "1991"
    assert calculator("(1+2)/4") == "0.75"
    assert calculator("2**10 - 7 % 4") == "1021"
    for bad in ("__import__('os')", "9**9**9", "1/0", "x+1", "1" * 300):
        with pytest.raises(ValueError):
            calculator(bad)


@pytest.mark.parametrize("code, error", [
    ("while True:\n    pass", "CPU time|timed out"),  # whichever limit a loaded machine reaches first
    ("x = bytearray(2 * 1024**3)", "MemoryError .the tool.s memory limit is"),
    ("print('a' * 100_000)", "output exceeded"),
    ("import socket\ns = socket.create_connection(('93.184.216.34', 80), timeout=2)", "socket"),
    ("import os\nos.system('echo hi')", "os.system"),
    ("raise ValueError('boom')", "ValueError: boom"),
])  # fmt: skip
@pytest.mark.slow
def test_sandbox_stops_what_it_must(toolbox, code, error):
    result = toolbox.call("python", {"code": code})
    assert result.error and re.search(error, result.text), result


def test_sandbox_network_is_refused_even_without_the_audit_hook():
    """Below the audit hook: where the machine allows it the child has no network interface at all."""
    from asyncflow.envs.sandbox import network_namespace_prefix, subprocess  # noqa: PLC0415

    prefix = network_namespace_prefix()
    if not prefix:
        pytest.skip("no unprivileged network namespace on this machine: the audit hook alone refuses sockets")
    probe = "import socket; s = socket.socket(); s.settimeout(2); print(s.connect_ex(('93.184.216.34', 80)))"
    out = subprocess.run([*prefix, "python3", "-c", probe], capture_output=True, text=True, timeout=20).stdout
    assert out.strip() not in ("0", ""), out  # ENETUNREACH, never a connection


def test_python_tool_runs_code_and_wall_clock_timeout_kills_it(toolbox):
    assert toolbox.call("python", {"code": "print(6 * 7)"}).text == "42\n"
    sleepy = ToolBox(timeout_s=0.5, limits=SandboxLimits(timeout_s=0.5, cpu_s=5))
    t0 = time.monotonic()
    result = sleepy.call("python", {"code": "import time\ntime.sleep(30)"})
    assert result.timeout and result.error and time.monotonic() - t0 < 15, "killed, not left to sleep 30 s"


def test_hanging_or_raising_in_process_tool_is_cut_off():
    box = ToolBox({"hang": lambda: time.sleep(30), "boom": lambda: 1 / 0, "flood": lambda: "x" * 10_000},
                  timeout_s=0.2, max_output_chars=100)
    assert box.call("hang", {}).timeout
    assert box.call("boom", {}).error and "ZeroDivisionError" in box.call("boom", {}).text
    assert len(box.call("flood", {}).text) < 120
    assert box.call("nope", {}).error
    box.close()


def test_parser_reads_calls_and_reports_malformed_ones():
    text = "let me compute " + format_tool_call("calculator", {"expression": "1+2"})
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "1+2"})]
    assert parse_tool_calls("42") == []
    for bad in ("<tool_call>{bad json</tool_call>", "<tool_call>{}", '<tool_call>["x"]</tool_call>',
                '<tool_call>{"name": "c", "arguments": 3}</tool_call>', "</tool_call>"):
        assert isinstance(parse_tool_calls(bad), ToolCallError), bad


def test_tool_env_episode_with_malformed_call_and_error_counts(toolbox):
    env = make_environment("calculator", toolbox=toolbox, verifier=lambda text, row: float(text == row["answer"]))
    assert isinstance(env, ToolEnv)
    env.reset({"answer": "1991", "expression": "37*48+215"})
    bad = env.step("<tool_call>{oops</tool_call>")
    assert not bad.done and bad.observation.startswith("error: malformed")
    wrong_tool = env.step(format_tool_call("python", {"code": "print(1)"}))  # not offered by `calculator`
    assert not wrong_tool.done and "unknown tool" in wrong_tool.observation
    ok = env.step(format_tool_call("calculator", {"expression": "37*48+215"}))
    assert ok.observation == "1991"
    final = env.step("1991")
    assert final.done and final.reward == 1.0
    assert final.info == {"tool_calls": 2, "tool_errors": 1, "tool_timeouts": 0, "malformed_calls": 1}
    assert env.demonstration({"answer": "1991", "expression": "37*48+215"})[1] == "1991"


def test_unknown_environment_is_named():
    with pytest.raises(EnvironmentSpecError, match="nope"):
        make_environment("nope")
    with pytest.raises(EnvironmentSpecError, match="no_such_module"):
        make_environment("no_such_module:factory")
