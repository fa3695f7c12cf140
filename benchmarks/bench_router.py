"""Benchmark: the replica router's session affinity against round-robin on a multi-turn workload over vLLM
replicas (CPU build): prefix-cache hit rate and step time, side by side in one run.

Owns nothing the library uses. `--replicas` (2) `VLLMInferenceEngine` replicas of `--model` (default
`preset:qwen2.5-tiny`), each behind its `EngineService`, prefix caching on (as the engine always runs). `--episodes`
multi-turn episodes run together; an episode opens with its own system prompt of `--system-tokens` random token ids
and each turn appends a user message of `--user-tokens` ids to the whole history (what the model said so far
included) and samples `--new-tokens`. A *step* is one turn of every episode, submitted together in a random order
(episodes reach the router in no fixed order); its time is until the last one finished. Two routings of the same
workload (fresh random ids each round, so no round finds another's blocks):
- `affinity`: `ReplicaRouter` with each episode's id as its session (what `asyncflow serve --replicas` and the agent
  rollout do);
- `round_robin`: the requests dealt to the replicas in turn, whatever their episode.
The routings alternate for `--rounds` rounds each. Hit rate: prompt tokens vLLM took from its prefix cache
(`Completion.cached_prompt_tokens`, vLLM's `num_cached_tokens`) over all prompt tokens. Then one more affinity round
with a rolling weight update (`ReplicaRouter.update_weights`) started during its second step: every request
submitted to a replica while it was being updated is counted (must be 0). An update empties a replica's prefix
cache, so that round's hit rate is reported apart.

Run: PYTHONPATH=src .venv-vllm/bin/python benchmarks/bench_router.py [--episodes 16 --turns 4 --rounds 2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from asyncflow.engines.base import Completion, SamplingParams  # noqa: E402
from asyncflow.engines.service import EngineService  # noqa: E402


class Watched:
    """A replica whose submissions and update windows are recorded (to count requests sent during an update)."""

    def __init__(self, service: EngineService):
        self.service = service
        self.submitted: list[float] = []
        self.updating: list[tuple[float, float]] = []

    def submit(self, prompt_ids, params=None, *, on_tokens=None, session=None) -> Future[Completion]:
        self.submitted.append(time.monotonic())
        return self.service.submit(prompt_ids, params, on_tokens=on_tokens)

    def update_weights(self, state_dict, version, *, timeout):
        start = time.monotonic()
        try:
            self.service.update_weights(state_dict, version, timeout=timeout)
        finally:
            self.updating.append((start, time.monotonic()))

    def sent_while_updating(self) -> int:
        return sum(start <= t <= end for start, end in self.updating for t in self.submitted)

    def __getattr__(self, name):
        return getattr(self.service, name)


class RoundRobin:
    """The baseline: request k goes to replica k mod N, sessions ignored."""

    def __init__(self, replicas):
        self.replicas, self._next = replicas, itertools.cycle(range(len(replicas)))

    def submit(self, prompt_ids, params=None, *, session=None) -> Future[Completion]:
        return self.replicas[next(self._next)].submit(prompt_ids, params)


def run_round(router, args, rng: random.Random, vocab: int, update=None) -> dict:
    """`args.turns` steps of `args.episodes` episodes through `router`; `update()` starts during the second."""
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
    ids = lambda n: [rng.randrange(16, vocab) for _ in range(n)]  # noqa: E731
    histories = [ids(args.system_tokens) for _ in range(args.episodes)]
    prompt_tokens = cached = 0
    step_s = []
    updater = None
    for turn in range(args.turns):
        for history in histories:
            history += ids(args.user_tokens)
        start = time.perf_counter()
        order = rng.sample(range(args.episodes), args.episodes)
        futures = dict((e, router.submit(list(histories[e]), params, session=f"episode-{e}")) for e in order)
        if turn == 1 and update is not None:
            updater = threading.Thread(target=update)
            updater.start()
        for e, future in futures.items():
            completion = future.result(timeout=600)
            history = histories[e]
            history += completion.response_ids
            prompt_tokens += len(completion.prompt_ids)
            cached += completion.cached_prompt_tokens or 0
        step_s.append(time.perf_counter() - start)
    if updater is not None:
        updater.join(600)
    return {"hit_rate": cached / prompt_tokens, "step_s": statistics.median(step_s[1:]),
            "prompt_tokens": prompt_tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="preset:qwen2.5-tiny")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()

    from asyncflow.engines.vllm_engine import make_vllm_inference_engine
    from asyncflow.models.loading import load_model, resolve_model_path
    from asyncflow.serving.router import ReplicaRouter

    max_len = args.system_tokens + args.turns * (args.user_tokens + args.new_tokens) + 64
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
    engines = [make_vllm_inference_engine(model_path=args.model, max_batch_size=args.episodes, seed=r,
                                          max_model_len=max_len) for r in range(args.replicas)]
    replicas = [Watched(EngineService(engine, params, name=f"replica-{r}")) for r, engine in enumerate(engines)]
    try:
        vocab = engines[0].vocab_size
        weights = load_model(resolve_model_path(args.model)).state_dict()
        new_weights = {name: tensor + 1e-3 * torch.randn_like(tensor) for name, tensor in weights.items()}
        rng = random.Random(0)
        results: dict[str, list[dict]] = {"affinity": [], "round_robin": []}
        for _ in range(args.rounds):
            router = ReplicaRouter(replicas)  # type: ignore[arg-type]  # Watched stands in for EngineService
            results["affinity"].append(run_round(router, args, rng, vocab))
            results["round_robin"].append(run_round(RoundRobin(replicas), args, rng, vocab))
        summary = {
            kind: {"hit_rate": round(statistics.mean(x["hit_rate"] for x in rounds), 4),
                   "step_s_median": round(statistics.median(x["step_s"] for x in rounds), 3),
                   "rounds": rounds}
            for kind, rounds in results.items()
        }
        summary["hit_rate_ratio"] = round(summary["affinity"]["hit_rate"] / max(summary["round_robin"]["hit_rate"],
                                                                                1e-9), 2)
        router = ReplicaRouter(replicas)  # type: ignore[arg-type]
        updated = run_round(router, args, rng, vocab, lambda: router.update_weights(new_weights, 1, timeout=600))
        summary["affinity_with_an_update"] = updated
        summary["requests_sent_to_a_replica_being_updated"] = sum(w.sent_while_updating() for w in replicas)
        summary["updates"] = [len(w.updating) for w in replicas]
        summary["config"] = vars(args)
        print(json.dumps(summary, indent=1))
    finally:
        for replica in replicas:
            replica.service.close()
        for engine in engines:
            engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
