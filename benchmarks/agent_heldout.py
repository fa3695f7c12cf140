"""Held-out accuracy of a run's agent, measured by the agent itself: each model of the run (its SFT model, and its
newest checkpoint) is served with `asyncflow serve` (the run's `agent.chat_template`), and the run's `agent.fn` solves
every held-out prompt through the `openai` client, as a user would run it; its final answers are scored with the
run's reward functions (solved = reward >= 1, as the run's own evaluation counts), and with each `--also` reward
function on the same answers.

Owns nothing the library uses. The agent asks for what it asks for (`examples/agents/calculator_agent.py` asks for
greedy decoding, `temperature=0`); outside a training run nothing overrides it.

Run: .venv/bin/python benchmarks/agent_heldout.py RUN_DIR [RUN_DIR ...] [--models sft final] [--also exact_match]
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def served(model: Path, chat_template: str | None, threads: int):
    """`asyncflow serve MODEL` on a free loopback port -> (process, base URL, key); waits until it accepts."""
    key = secrets.token_hex(16)
    port_file = Path(tempfile.mkdtemp()) / "port"
    cmd = [sys.executable, "-m", "asyncflow.cli", "serve", str(model), "--port", "0", "--port-file", str(port_file),
           "--threads", str(threads), *(["--chat-template", chat_template] if chat_template else [])]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, ASYNCFLOW_API_KEY=key), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{' '.join(cmd)} did not start: {proc.communicate()[1][-2000:]}")
        time.sleep(0.2)
    return proc, f"http://127.0.0.1:{port_file.read_text().strip()}/v1", key


def agent_accuracy(run_dir: Path, model: Path, concurrency: int, threads: int, also: list[str]) -> list[float]:
    """Accuracy of the run's agent on its held-out prompts, `model` served: by the run's rewards, then by each of
    `also`."""
    import openai

    from asyncflow.config import load_config
    from asyncflow.rewards import CompositeReward
    from asyncflow.workers.agent import AgentRow, resolve_agent
    from asyncflow.workflow.setup import datasets, weighted_reward_specs

    config = load_config(run_dir / "config.yaml")
    agent = resolve_agent(config.agent.fn)
    rewards = [CompositeReward(weighted_reward_specs(config)), *(CompositeReward([(spec, 1.0)]) for spec in also)]
    test = datasets(config)[1]
    proc, url, key = served(model, config.agent.chat_template, threads)
    try:
        client = openai.OpenAI(base_url=url, api_key=key, max_retries=2, timeout=120)
        name = client.models.list().data[0].id

        def solve(example) -> list[float]:
            row = AgentRow(prompt=example.prompt, answer=example.answer, model=name, episode_id="",
                           metadata={"answer": example.answer, **example.metadata})
            answer = agent(client, row)
            return [r(answer, example.answer, **example.metadata) if isinstance(answer, str) else float(answer)
                    for r in rewards]

        with ThreadPoolExecutor(concurrency) as pool:
            scores = list(pool.map(solve, test))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return [sum(row[k] >= 1.0 for row in scores) / len(scores) for k in range(len(rewards))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--models", nargs="+", default=["sft", "final"], choices=["sft", "final"],
                        help="sft: RUN_DIR/sft (before RL); final: the run's newest checkpoint")
    parser.add_argument("--concurrency", type=int, default=16, help="agent episodes at once")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each server")
    parser.add_argument("--also", nargs="*", default=[], help="reward functions to score the same answers with too")
    args = parser.parse_args()
    columns = [f"{m}/{r}" for m in args.models for r in ["run", *args.also]]
    print(f"{'run':<40} " + " ".join(f"{c:>18}" for c in columns))
    for run_dir in args.run_dirs:
        cells = []
        for which in args.models:
            model = run_dir / "sft" if which == "sft" else run_dir
            accuracies = agent_accuracy(run_dir.resolve(), model.resolve(), args.concurrency, args.threads, args.also)
            cells += [f"{100 * accuracy:.1f}%" for accuracy in accuracies]
        print(f"{str(run_dir):<40} " + " ".join(f"{c:>18}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
