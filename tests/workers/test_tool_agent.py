"""The openai function-calling agent (`examples/agents/calculator_agent.py`, `examples/tool_agent_grpo.yaml`): its SFT
demonstrations are the ids the run's server gives its calls (prompt with the tools, call, tool result, answer), and it
trains end to end with every turn's trained ids equal to the sampled ones."""

import json
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")

from asyncflow.cli import main  # noqa: E402
from asyncflow.config import load_config  # noqa: E402
from asyncflow.envs.tool_calls import format_tool_call  # noqa: E402
from asyncflow.models.loading import load_tokenizer, resolve_model_path  # noqa: E402
from asyncflow.serving.tool_calling import template_messages  # noqa: E402
from asyncflow.workers.agent import resolve_agent  # noqa: E402
from asyncflow.workflow.setup import datasets  # noqa: E402
from asyncflow.workflow.sft import sft_samples  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tool_agent_grpo.yaml"
AGENT = ROOT / "examples" / "agents" / "calculator_agent.py"


def example_config(tmp_path, *overrides):
    return load_config(EXAMPLE, [f"run.output_dir={tmp_path}", f"agent.fn={AGENT}:solve",
                                 f"agent.chat_template={AGENT.parent / 'calculator_chat.jinja'}", *overrides])


@pytest.mark.slow
def test_sft_demonstrations_are_the_ids_the_server_gives_the_agents_calls(tmp_path):
    config = example_config(tmp_path)
    tokenizer = load_tokenizer(resolve_model_path(config.model.path, seed=0))
    agent = resolve_agent(config.agent.fn)
    template = Path(config.agent.chat_template).read_text()
    to_sample = sft_samples(config, tokenizer)
    for example in datasets(config)[0].examples[:4]:
        sample = to_sample(example)
        call = format_tool_call("calculator", {"expression": example.metadata["expression"]})
        result = agent.__globals__["calculate"](example.metadata["expression"])
        assert result == example.answer
        # what the server renders when the agent sends the call back (its sampled text as the content) with the tool
        # result, followed by the answer turn
        conversation = [{"role": "user", "content": example.prompt}, {"role": "assistant", "content": call},
                        {"role": "tool", "tool_call_id": "call_0", "content": result},
                        {"role": "assistant", "content": example.answer}]
        text = tokenizer.apply_chat_template(conversation, chat_template=template, tools=agent.tools, tokenize=False)
        assert text.startswith(f"<s>calculator:{example.prompt}<tool_call>")
        assert list(sample.prompt_ids) + list(sample.response_ids) == tokenizer(text, add_special_tokens=False)[
            "input_ids"]
        # outside a training episode (`asyncflow serve`) the call comes back as `tool_calls`, its arguments an object
        # (`template_messages`): the template writes it as the model did
        returned = {"role": "assistant", "tool_calls": [{"id": "call_0", "type": "function", "function": {
            "name": "calculator", "arguments": json.dumps({"expression": example.metadata["expression"]})}}]}
        resent = template_messages([conversation[0], returned, *conversation[2:]])
        assert tokenizer.apply_chat_template(resent, chat_template=template, tools=agent.tools, tokenize=False) == text
        trained = [i for i, m in zip(sample.response_ids, sample.loss_mask) if m]
        assert tokenizer.decode(trained) == f"{call}</s>{example.answer}</s>"


def test_the_calculator_agent_evaluates_safely():
    calculate = resolve_agent(f"{AGENT}:solve").__globals__["calculate"]
    assert calculate("37*48+21") == "1797" and calculate("-(2+3)*4") == "-20"
    for bad in ("__import__('os')", "2**99999", "1/0", "(", "9" * 13):
        assert calculate(bad).startswith("error:")


@pytest.mark.slow
def test_the_tool_agent_trains_with_the_sampled_ids_of_every_turn(tmp_path, capsys, one_torch_thread):
    """A short SFT (fixed steps: enough for the call format), then 2 GRPO steps of the agent; the episodes make tool
    calls (a second chat call after the tool result) and the trained ids of every turn are the sampled ones."""
    code = main(["train", str(EXAMPLE), f"--output={tmp_path}", "run.progress=false", f"agent.fn={AGENT}:solve",
                 f"agent.chat_template={AGENT.parent / 'calculator_chat.jinja'}", "sft.steps=60", "sft.lr=3e-3",
                 "sft.stop_accuracy=null", "train.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4",
                 "eval.every=0", "checkpoint.every=0", "data.test_size=4", "--threads=1"])
    assert code == 0
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "loss" in s]
    assert len(trained) == 2
    for s in trained:
        assert s["agent/calls_mean"] > 1.1, s  # episodes called the calculator (a second chat call), then answered
        assert s["rollout/retokenize_drift_tokens"] == 0 and s["agent/dropped_calls"] == 0 and s["agent/errors"] == 0
        assert s["agent/trained_tokens"] > 0 and s["loss"] == s["loss"]  # finite (0 when no group had a signal)
