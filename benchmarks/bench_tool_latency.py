"""Benchmark: multi-turn rollout throughput with a slow tool, the engine going on with other episodes while
one waits on its tool (continuous batching across turns) vs an engine that waits for each tool call.

Owns nothing the library imports. Every episode has `--turns` model turns; after each but the last the
model's text goes to a tool that takes `--tool-ms` (50 ms: a sandboxed interpreter, a web search) and its
output is appended as ids. Three ways to run `--episodes` such episodes on one tiny model, timed in one
process, interleaved, best of `--reps`:

- `continuous`: `MultiTurnRolloutWorker` (what training runs): every episode on its own pool thread, every
  turn a request to one `EngineService`; while an episode waits on its tool the others keep decoding and its
  next turn joins the running batch when the tool returns.
- `wait_each_call`: turns in lockstep: one batched `generate` for every open episode's turn, then the tool
  calls one after another while the engine waits (a loop over the batch calling tools).
- `wait_per_turn`: the same lockstep, with the turn's tool calls run in parallel (the engine waits once per
  turn, for the slowest call): a stronger baseline, reported beside the other.

Turns end at a stop token (about 1 in 12 tokens of the random model) or after `--new-tokens`; sampling
differs between the runs, so throughput is sampled (trained) tokens per second, and the ratio is
continuous tokens/s over the other run's tokens/s.

    PYTHONPATH=src python benchmarks/bench_tool_latency.py           # ~1 min on 2 cores
    PYTHONPATH=src python benchmarks/bench_tool_latency.py --quick
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from asyncflow.data.prompts import Prompt
from asyncflow.engines.base import GenerationRequest, SamplingParams
from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.envs import StepResult
from asyncflow.models.loading import load_model, load_tokenizer, resolve_model_path
from asyncflow.workers.multiturn import Episode, EpisodeRunner, MultiTurnRolloutWorker, TurnTemplate

STOP_TOKENS = tuple(range(40, 49))


class SlowToolEnv:
    """Each model turn but the last is answered by a tool that takes `latency_s`; the last turn ends the episode."""

    def __init__(self, turns: int, latency_s: float):
        self.turns, self.latency_s = turns, latency_s

    def reset(self, row):
        self.turn = 0

    def step(self, model_text: str) -> StepResult:
        self.turn += 1
        if self.turn == self.turns:
            return StepResult(reward=1.0, done=True)
        time.sleep(self.latency_s)  # the tool call
        return StepResult(observation=f"result {self.turn}")


def continuous(engine, runner: EpisodeRunner, prompts: list[Prompt], concurrency: int) -> list[Episode]:
    worker = MultiTurnRolloutWorker(engine, runner.params, 1, runner, concurrency=concurrency)
    return [Episode(r.prompt_ids, r.response_ids, loss_mask=r.loss_mask) for r in worker.generate(prompts)]


def lockstep(engine, runner: EpisodeRunner, prompts: list[Prompt], parallel_tools: bool) -> list[Episode]:
    episodes = [Episode(list(p.prompt_ids)) for p in prompts]
    envs = [runner.make_env() for _ in prompts]
    for env in envs:
        env.reset({})
    open_ = list(range(len(prompts)))
    pool = ThreadPoolExecutor(len(prompts)) if parallel_tools else None
    while open_:
        requests = [GenerationRequest(i, episodes[i].prompt_ids + episodes[i].response_ids) for i in open_]
        turn = {c.request_id: c for c in engine.generate(requests, runner.params)}
        for i in open_:
            episodes[i].add_sampled(turn[i])
        texts = {i: runner.tokenizer.decode(turn[i].response_ids, skip_special_tokens=True) for i in open_}
        if pool is not None:
            results = dict(zip(open_, pool.map(lambda i: envs[i].step(texts[i]), open_)))
        else:
            results = {i: envs[i].step(texts[i]) for i in open_}
        still = []
        for i in open_:
            if not results[i].done:
                episodes[i].add_appended(runner.template.observation_ids(runner.tokenizer, results[i].observation))
                still.append(i)
        open_ = still
    if pool is not None:
        pool.shutdown()
    return episodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tool-ms", type=float, default=50.0)
    parser.add_argument("--new-tokens", type=int, default=64, help="most tokens per model turn")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="16 episodes, 1 rep")
    args = parser.parse_args()
    if args.quick:
        args.episodes, args.reps = 16, 1
    torch.set_num_threads(args.threads)
    path = resolve_model_path("preset:tiny-llama-tools")
    tokenizer = load_tokenizer(path)
    # ~1 in 12 tokens of the random model is a stop token: turns of mixed lengths (mean ~12), rarely cut
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=STOP_TOKENS)
    runner = EpisodeRunner(
        tokenizer, TurnTemplate.from_tokenizer(tokenizer), lambda: SlowToolEnv(args.turns, args.tool_ms / 1000),
        params, max_turns=args.turns + 1, max_context_tokens=10_000,
    )
    prompts = [Prompt(g, tokenizer.encode(f"{10 + g}*{37 + g}+{g}=", add_special_tokens=True), "0")
               for g in range(args.episodes)]
    engine = TorchInferenceEngine(load_model(path), max_batch_size=args.episodes, seed=0)
    runs = {
        "continuous": lambda: continuous(engine, runner, prompts, args.episodes),
        "wait_each_call": lambda: lockstep(engine, runner, prompts, parallel_tools=False),
        "wait_per_turn": lambda: lockstep(engine, runner, prompts, parallel_tools=True),
    }
    runs["continuous"]()  # warm-up
    best: dict[str, tuple[float, int]] = {}
    for _ in range(args.reps):
        for name, run in runs.items():
            t0 = time.perf_counter()
            episodes = run()
            seconds = time.perf_counter() - t0
            sampled = sum(sum(e.loss_mask) for e in episodes)
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, sampled)
    base = best["continuous"][0]
    rate = best["continuous"][1] / base
    print(f"{args.episodes} episodes x {args.turns} turns (<= {args.new_tokens} sampled tokens each), tool "
          f"{args.tool_ms:g} ms after each turn but the last; best of {args.reps}, torch threads {args.threads}")
    print(f"{'mode':<16} {'seconds':>8} {'sampled tokens':>15} {'tokens/s':>9} {'continuous / this':>18}")
    for name, (seconds, sampled) in best.items():
        print(f"{name:<16} {seconds:8.2f} {sampled:15d} {sampled / seconds:9.0f} {rate / (sampled / seconds):17.2f}x")


if __name__ == "__main__":
    main()
