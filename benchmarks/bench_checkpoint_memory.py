"""Peak resident memory of writing a checkpoint and of an export, on a ~120M-parameter Llama-shaped model, for this
checkout and (optionally) another, to show whether they stream the weights or copy them.

Each measurement runs in a fresh process, which holds the policy's weights as a trainer does (a loaded model's
state dict, made resident), resets its peak resident size (/proc/self/clear_refs) and prints how far above its
resident size before the operation the peak went, in MiB and in copies of the weights:

- `checkpoint`: `save_checkpoint` of those weights (model.safetensors, an optimizer-free training state);
- `export`: `export_run` of that checkpoint into a Hugging Face folder (starting with no weights held).

    .venv/bin/python benchmarks/bench_checkpoint_memory.py                    # this checkout
    mkdir /tmp/asyncflow-before && git archive <commit> src | tar -x -C /tmp/asyncflow-before
    .venv/bin/python benchmarks/bench_checkpoint_memory.py --before-src /tmp/asyncflow-before/src

The model folder, run folder and both checkouts' outputs are written under a temporary folder; with
`--before-src` the files each checkout wrote are compared byte for byte. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=14, num_attention_heads=12,
             num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=True, max_position_embeddings=512)


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _measure(operation) -> float:
    """MiB the peak resident size rose above the resident size before `operation()`."""
    before = _status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    operation()
    return _status_mib("VmHWM") - before


def child(args) -> None:
    import torch

    torch.set_num_threads(1)
    from asyncflow.models.loading import load_model
    from asyncflow.workflow.checkpoint import save_checkpoint
    from asyncflow.workflow.export import export_run

    run_dir = Path(args.run_dir)
    if args.operation == "checkpoint":
        model = load_model(args.model)
        # resident, as a trainer's weights are (a loaded model's may be pages of its file not yet read)
        for parameter in model.parameters():
            parameter.data = parameter.data.clone()
        weights = {k: v.detach() for k, v in model.state_dict().items()}
        nbytes = sum(p.nbytes for p in model.parameters())
        rise = _measure(lambda: save_checkpoint(run_dir, 1, weights, {"engine": "torch"}, {"cursor": 0}, keep=1))
    else:
        nbytes = (run_dir / "checkpoints" / "step_1" / "model.safetensors").stat().st_size
        rise = _measure(lambda: export_run(run_dir, Path(args.out), replace=True))
    print(json.dumps({"rise_mib": rise, "weights_mib": nbytes / 2**20}))


def run_child(src: Path, operation: str, model: Path, run_dir: Path, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", operation, "--model", str(model), "--run-dir", str(run_dir),
         "--out", str(out)], env=env, capture_output=True, text=True, timeout=1800, check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{operation} with {src} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def build_model(folder: Path) -> None:
    """A random-initialised Llama of SHAPE with a tokenizer (a preset's: export copies the run's tokenizer)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from asyncflow.models.loading import resolve_model_path

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(resolve_model_path("preset:tiny-llama", seed=0))).save_pretrained(folder)


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name not in ("manifest.json", "rng.pt",
                                                                                 "asyncflow_export.json")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-src", type=Path, help="the src folder of another checkout, measured alongside")
    parser.add_argument("--child")
    parser.add_argument("--model")
    parser.add_argument("--run-dir")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.child:
        args.operation = args.child
        return child(args)
    sys.path.insert(0, str(SRC))
    from asyncflow.config import build_config, dump_config

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tmp / "model"
        build_model(model)
        checkouts = {"this checkout": SRC, **({"before": args.before_src} if args.before_src else {})}
        files = {}
        for name, src in checkouts.items():
            run_dir, out = tmp / f"run-{len(files)}", tmp / f"export-{len(files)}"
            run_dir.mkdir()
            dump_config(build_config({}, [f"model.path={model}", f"run.output_dir={run_dir}"]),
                        run_dir / "config.yaml")
            checkpoint = run_child(src, "checkpoint", model, run_dir, out)
            export = run_child(src, "export", model, run_dir, out)
            weights = checkpoint["weights_mib"]
            print(f"{name}: weights {weights:.0f} MiB; peak above resident: checkpoint {checkpoint['rise_mib']:.0f} "
                  f"MiB ({checkpoint['rise_mib'] / weights:.2f} copies), export {export['rise_mib']:.0f} MiB "
                  f"({export['rise_mib'] / weights:.2f} copies)")
            files[name] = {**digests(run_dir / "checkpoints"), **{f"export/{k}": v for k, v in digests(out).items()}}
        if len(files) == 2:
            a, b = files.values()
            print("files identical:", a == b, "" if a == b else sorted(k for k in a.keys() | b.keys()
                                                                       if a.get(k) != b.get(k)))
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
