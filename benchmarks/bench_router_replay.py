"""Router replay (R3) on `preset:tiny-moe`: the gap between the trainer's recomputed log-probs of the sampled tokens and
the built-in rollout engine's, with and without replay, and how many routing choices flip between the two.

Owns nothing the library uses. The rollout engine (`TorchInferenceEngine`, its routing record on) samples
`--prompts` x `--samples` responses of `--tokens` tokens at T = 1; the trainer's policy (`tri_model_logprobs`, packed
and unpacked) recomputes their log-probs routing on its own and replaying the record. Setups, each its own row:
- `tied`: routers with a near-tie (`asyncflow.models.moe.tie_experts`, relative 1e-7), fp32 on both sides: the only
  difference between the two forwards is float rounding, which decides the tied experts' order;
- `bf16 rollout`: the preset as built, the engine's weights in bfloat16, the trainer's fp32 (`rollout.dtype=bfloat16`);
- `a version behind`: the preset as built, fp32 on both sides, the trainer one AdamW step (lr 5e-5, the main job's)
  past the weights that sampled (async k=1 without `stale_old_logprobs: policy`).
Replay can make the log-probs equal only where routing is the sole difference (`tied`); in the others it removes the
flips' share of the gap.

Prints per setup and packing: max and mean |log pi_train - log pi_rollout| over sampled tokens, own routing and
replayed, and the fraction of (position, layer) choices whose expert set differs between the trainer's own routing
and the record.

Run: .venv/bin/python benchmarks/bench_router_replay.py [--prompts 16] [--samples 4] [--tokens 32]
"""

from __future__ import annotations

import argparse
import copy

import torch

from asyncflow.engines.base import GenerationRequest, SamplingParams
from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.models.loading import load_model, resolve_model_path
from asyncflow.models.logprobs import TrainSample
from asyncflow.models.moe import RouterReplay, replay_order, routing_recorder, tie_experts
from asyncflow.models.tri_model import tri_model_logprobs


def rollouts(engine_model: torch.nn.Module, prompts: int, samples: int, tokens: int
             ) -> tuple[list[TrainSample], torch.Tensor]:
    engine = TorchInferenceEngine(engine_model, max_batch_size=prompts * samples, record_routing=True)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 90, (3 + i % 8,), generator=g).tolist() for i in range(prompts)]
    requests = [GenerationRequest((i, k), p) for i, p in enumerate(ids) for k in range(samples)]
    done = sorted(engine.generate(requests, SamplingParams(max_new_tokens=tokens)), key=lambda c: c.request_id)
    rows = [TrainSample(c.prompt_ids, c.response_ids, c.request_id[0], routed_experts=c.routed_experts) for c in done]
    return rows, torch.nn.utils.rnn.pad_sequence([torch.tensor(c.logprobs) for c in done], batch_first=True)


def flipped(model: torch.nn.Module, rows: list[TrainSample]) -> float:
    """Fraction of recorded (position, layer) choices whose expert set the model's own routing changes."""
    recorder = routing_recorder(model)
    with torch.no_grad(), recorder.capture() as routed:
        tri_model_logprobs(model, rows, packing="off")
    record, recorded = replay_order(rows, False, routed[0].shape[1], routed[0].shape[2])
    differ = (routed[0].long().sort(-1).values != record.sort(-1).values).any(-1)  # [T, layers]
    return float(differ[recorded].float().mean())


def one_step_ahead(model: torch.nn.Module, rows: list[TrainSample]) -> torch.nn.Module:
    engine = TorchTrainEngine(model, lr=5e-5)
    g = torch.Generator().manual_seed(2)
    engine.backward_micro_batch(rows, lambda out: (
        -(torch.randn(out.policy.logprobs.shape, generator=g) * out.policy.logprobs).sum(), {}))
    engine.optimizer_step(1.0 / sum(len(r.response_ids) for r in rows))
    return engine.model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    preset = resolve_model_path("preset:tiny-moe")
    sizes = (args.prompts, args.samples, args.tokens)
    setups = {}
    tied = tie_experts(load_model(preset))
    setups["tied"] = (tied, *rollouts(copy.deepcopy(tied), *sizes))
    built = load_model(preset)
    setups["bf16 rollout"] = (built, *rollouts(load_model(preset, dtype="bfloat16"), *sizes))
    rows, logprobs = rollouts(copy.deepcopy(built), *sizes)
    setups["a version behind"] = (one_step_ahead(copy.deepcopy(built), rows), rows, logprobs)
    print(f"preset:tiny-moe, {args.prompts} prompts x {args.samples} samples x {args.tokens} tokens, T = 1")
    print(f"{'setup':<18}{'packing':>8}{'flipped choices':>17}{'own max':>11}{'own mean':>11}"
          f"{'replay max':>12}{'replay mean':>13}")
    for name, (model, rows, rollout) in setups.items():
        replay = RouterReplay(model)
        flips = flipped(model, rows)
        for packing in ("on", "off"):
            gaps = []
            for with_replay in (None, replay):
                with torch.no_grad():
                    out = tri_model_logprobs(model, rows, packing=packing, replay=with_replay)
                gap = (out.policy.logprobs - rollout).abs()[out.policy.mask]
                gaps += [float(gap.max()), float(gap.mean())]
            own_max, own_mean, replay_max, replay_mean = gaps
            print(f"{name:<18}{packing:>8}{flips:>17.4f}{own_max:>11.2e}{own_mean:>11.2e}{replay_max:>12.2e}"
                  f"{replay_mean:>13.2e}")


if __name__ == "__main__":
    main()
