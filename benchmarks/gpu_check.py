"""GPU check: the figures a user with a GPU asks for first, measured on one CUDA device in one invocation.

Owns nothing the library uses. Parts (`--parts`, default all):

1. `agreement`: log-prob agreement between the inference engine and the trainer. The built-in inference engine
   samples responses (temperature 1) with its weights in fp32 or bf16; the trainer recomputes the log-probs of
   the same tokens (`logprobs`, no gradient) in fp32, in bf16 mixed precision (`train.precision: bf16`), and with
   the FSDP2 engine (world_size 1, bf16). Prints mean and max |difference| per token for every pair.
2. `update`: weight-update time, trainer -> bf16 inference engine on the same GPU: the full state dict from the
   trainer (`state_dict()` after a step; FSDP2: gathered to rank 0) plus `update_weights` into the engine.
3. `workflows`: `asyncflow train` runs (inline runtime, bf16, activation checkpointing) in `sync` and `async`
   (max staleness 1) with the torch trainer, and `sync` with the FSDP2 trainer (world_size 1): median step
   time over the steps after the first two.
4. `vllm`: the same agreement with vLLM as the inference engine when vllm is importable; otherwise it says so.

Run: python benchmarks/gpu_check.py [--preset base-llama] [--parts agreement,update,workflows,vllm] [--steps 8]
(`scripts/gpu_check.sh` runs it after the `gpu` tests).
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from asyncflow.config import AlgoConfig
from asyncflow.engines.base import GenerationRequest, SamplingParams
from asyncflow.engines.fsdp2_train import FSDP2TrainEngine
from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.models.loading import load_model, resolve_model_path
from asyncflow.models.logprobs import TrainSample
from asyncflow.runtime.inline import ProcessRanks
from asyncflow.workers.trainer import PolicyLoss
from asyncflow.workflow.compare import train_run

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def requests(vocab: int, prompts: int, group: int, prompt_tokens: int = 16) -> list[GenerationRequest]:
    rng = random.Random(0)
    out = []
    for p in range(prompts):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_tokens)]
        out += [GenerationRequest(p * group + k, prompt) for k in range(group)]
    return out


def sample_rows(engine, path, args) -> tuple[list[TrainSample], list[torch.Tensor]]:
    """Responses sampled by `engine`, as training rows in request order (groups consecutive), and their
    sampling log-probs."""
    vocab = load_model(path).config.vocab_size
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    done = sorted(engine.generate(requests(vocab, args.prompts, args.group), params), key=lambda c: c.request_id)
    samples = [TrainSample(c.prompt_ids, c.response_ids, c.request_id // args.group) for c in done]
    return samples, [torch.tensor(c.logprobs) for c in done]


def difference(sampled: list[torch.Tensor], recomputed: torch.Tensor) -> tuple[float, float, int]:
    """(mean, max) |sampling - recomputed| log-prob over all response tokens, and the token count."""
    diffs = torch.cat([(lp - recomputed[i, : len(lp)].cpu().float()).abs() for i, lp in enumerate(sampled)])
    return float(diffs.mean()), float(diffs.max()), diffs.numel()


TRAINERS = ("torch fp32", "torch bf16", "fsdp2 bf16 (1 rank)")


def trainers(path, args, names=TRAINERS):
    """(name, engine) for each trainer configuration compared, built one at a time; the caller closes each."""
    for name in names:
        if name.startswith("torch"):
            yield name, TorchTrainEngine(load_model(path, device=args.device), lr=1e-5, precision=name.split()[1])
        else:
            yield name, FSDP2TrainEngine(load_model(path, device=args.device), model_path=path, world_size=1,
                                         lr=1e-5, precision="bf16", timeout_s=300, launcher=ProcessRanks)


def agreement(path, args) -> None:
    print(f"\n== log-prob agreement: inference engine vs trainer ({args.prompts}x{args.group} samples, "
          f"up to {args.max_new_tokens} tokens, temperature 1)")
    rollouts = {}
    for name, dtype in DTYPES.items():
        engine = TorchInferenceEngine(load_model(path, device=args.device).to(dtype).eval(), max_batch_size=256,
                                      device=args.device, seed=0)
        rollouts[name] = sample_rows(engine, path, args)
        del engine
    print(f"{'rollout':<12} {'trainer':<22} {'mean |dlogp|':>13} {'max |dlogp|':>12} {'tokens':>7} "
          f"{'mean logp':>10}")
    for trainer_name, trainer in trainers(path, args):
        try:
            for rollout_name, (samples, sampled) in rollouts.items():
                recomputed = trainer.logprobs(samples)
                mean, worst, tokens = difference(sampled, recomputed)
                mean_logp = float(torch.cat(sampled).mean())
                print(f"{'torch ' + rollout_name:<12} {trainer_name:<22} {mean:13.2e} {worst:12.2e} {tokens:7d} "
                      f"{mean_logp:10.3f}")
        finally:
            if hasattr(trainer, "close"):
                trainer.close()


def train_once(trainer, samples: list[TrainSample]) -> None:
    lengths = [len(s.response_ids) for s in samples]
    width = max(lengths)
    loss = PolicyLoss(torch.randn(len(samples), width), torch.full((len(samples), width), -2.0), None,
                      torch.ones(len(samples), width, dtype=torch.bool), lengths, AlgoConfig())
    trainer.backward_micro_batch(samples, loss)
    trainer.optimizer_step(1.0 / sum(lengths))


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def update(path, args) -> None:
    print("\n== weight update: trainer state dict -> bf16 inference engine on the same GPU (median of "
          f"{args.repeats})")
    engine = TorchInferenceEngine(load_model(path, device=args.device).to(torch.bfloat16).eval(), max_batch_size=64,
                                  device=args.device, seed=0)
    samples, _ = sample_rows(engine, path, argparse.Namespace(**{**vars(args), "prompts": 4}))
    print(f"{'trainer':<22} {'state_dict s':>13} {'update s':>10} {'total s':>9} {'MB (fp32)':>10}")
    for name, trainer in trainers(path, args):
        try:
            gather, load = [], []
            for version in range(1, args.repeats + 1):
                train_once(trainer, samples)
                synchronize(args.device)
                t0 = time.perf_counter()
                state = trainer.state_dict()
                synchronize(args.device)
                t1 = time.perf_counter()
                engine.update_weights(state, version)
                synchronize(args.device)
                gather.append(t1 - t0)
                load.append(time.perf_counter() - t1)
            size = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
            g, u = statistics.median(gather), statistics.median(load)
            print(f"{name:<22} {g:13.4f} {u:10.4f} {g + u:9.4f} {size:10.1f}")
        finally:
            if hasattr(trainer, "close"):
                trainer.close()


def workflows(path, args) -> None:
    print(f"\n== workflows: asyncflow train, inline runtime, {args.device}, bf16 + activation checkpointing, "
          f"{args.steps} steps (median step time over steps 3..)")
    common = [
        f"model.path=preset:{args.preset}", f"model.device={args.device}", "runtime.kind=inline", "run.progress=false",
        f"train.steps={args.steps}", "train.precision=bf16", "train.activation_checkpointing=true",
        "rollout.prompts_per_step=16", "rollout.group_size=8", "rollout.max_new_tokens=32", "train.micro_batch_size=64",
        "eval.every=0", "checkpoint.every=0", "export.at_end=false", "data.test_size=16", "observe.tensorboard=false",
    ]
    runs = {
        "sync, torch": ["workflow.mode=sync"],
        "async k=1, torch": ["workflow.mode=async", "workflow.max_staleness=1"],
        "sync, fsdp2 (1 rank)": ["workflow.mode=sync", "train.engine=fsdp2", "train.world_size=1"],
    }
    print(f"{'run':<22} {'step s (median)':>16} {'x sync':>7} {'samples/s':>10}")
    base = None
    with tempfile.TemporaryDirectory(prefix="asyncflow-gpu-") as tmp:
        for i, (name, overrides) in enumerate(runs.items()):
            try:
                rows = train_run([*common, *overrides], Path(tmp) / f"run{i}", timeout_s=540)
            except Exception as err:  # noqa: BLE001 - one failing mode is reported, the others still run
                print(f"{name:<22} FAILED: {str(err)[-1500:]}")
                continue
            walls = [r["wall_s"] for r in rows]
            steps = [b - a for a, b in zip(walls[1:], walls[2:], strict=False)] or [walls[-1]]
            median = statistics.median(steps)
            base = base or median
            samples = sum(r["rollout/samples"] for r in rows[2:]) / max(1e-9, walls[-1] - walls[1])
            print(f"{name:<22} {median:16.3f} {median / base:7.2f} {samples:10.1f}")


def vllm(path, args) -> None:
    print("\n== vLLM")
    if importlib.util.find_spec("vllm") is None:
        print("vllm is not importable here: the vLLM path is skipped (install it with scripts/setup_vllm.sh)")
        return
    from asyncflow.engines.base import make_inference_engine

    print(f"{'rollout':<12} {'trainer':<22} {'mean |dlogp|':>13} {'max |dlogp|':>12} {'tokens':>7}")
    for name, dtype in DTYPES.items():
        engine = make_inference_engine("vllm", model=load_model(path).to(dtype), max_batch_size=64, device=args.device,
                                       seed=0)
        try:
            samples, sampled = sample_rows(engine, path, args)
        finally:
            if hasattr(engine, "close"):
                engine.close()
        for trainer_name, trainer in trainers(path, args, TRAINERS[:2]):
            mean, worst, tokens = difference(sampled, trainer.logprobs(samples))
            print(f"{'vllm ' + name:<12} {trainer_name:<22} {mean:13.2e} {worst:12.2e} {tokens:7d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="base-llama")
    parser.add_argument("--parts", default="agreement,update,workflows,vllm")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda", help="cuda (cpu: a dry run of the script itself)")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device visible to torch")
    path = resolve_model_path(f"preset:{args.preset}")
    params = sum(p.numel() for p in load_model(path).parameters())
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device: {name} | torch {torch.__version__} | preset {args.preset} "
          f"({params / 1e6:.1f}M params)")
    for part in args.parts.split(","):
        t0 = time.perf_counter()
        {"agreement": agreement, "update": update, "workflows": workflows, "vllm": vllm}[part](path, args)
        print(f"[{part}: {time.perf_counter() - t0:.1f} s]")


if __name__ == "__main__":
    main()
