"""Peak resident memory of the driver of an FSDP2 trainer (2 ranks as local processes) on a ~120M-parameter
Llama-shaped model, for this checkout and (optionally) another: while the trainer is built as a run builds it
(`train_engine_options` + `make_train_engine`), and while one weight version is published through the
shared-memory transport (what a `stream`/`async` step does).

Each checkout runs in a fresh process that resets its peak (/proc/self/clear_refs) before each phase and prints
how far its peak rose above its resident size before the phase, in MiB and in copies of the weights.

    .venv/bin/python benchmarks/bench_fsdp2_driver_memory.py
    mkdir /tmp/asyncflow-before && git archive <commit> src | tar -x -C /tmp/asyncflow-before
    .venv/bin/python benchmarks/bench_fsdp2_driver_memory.py --before-src /tmp/asyncflow-before/src
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_checkpoint_memory import SRC, _measure, build_model  # noqa: E402


def child(model: str, run_dir: str) -> None:
    import inspect

    import torch

    torch.set_num_threads(1)
    from asyncflow.config import build_config
    from asyncflow.engines.base import make_train_engine
    from asyncflow.weights import make_weight_sync
    from asyncflow.workflow.setup import train_engine_options

    config = build_config({}, [f"model.path={model}", f"run.output_dir={run_dir}", "train.engine=fsdp2",
                               "train.world_size=2", "runtime.kind=inline", "runtime.call_timeout_s=1200"])
    engine = None

    def build() -> None:
        nonlocal engine
        if "policy" in inspect.signature(train_engine_options).parameters and \
                list(inspect.signature(train_engine_options).parameters)[1] == "model_path":
            options = train_engine_options(config, model)
        else:  # a checkout whose caller loaded the policy in the driver first
            from asyncflow.models.loading import load_model

            options = train_engine_options(config, load_model(model), model)
        engine = make_train_engine("fsdp2", **options)

    build_rise = _measure(build)
    publisher = make_weight_sync("shared_memory")
    weights = getattr(engine, "weight_stream", engine.state_dict)  # a checkout without streaming: the state dict
    publish_rise = _measure(lambda: publisher.publish(weights(), 1))
    extra = engine.metrics() if hasattr(engine, "metrics") else {}
    publisher.close()
    engine.close()
    print(json.dumps({"build_mib": build_rise, "publish_mib": publish_rise, **extra}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-src", type=Path)
    parser.add_argument("--child", nargs=2)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    sys.path.insert(0, str(SRC))
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        build_model(model)
        weights_mib = sum(p.stat().st_size for p in model.glob("*.safetensors")) / 2**20
        for name, src in {"this checkout": SRC, **({"before": args.before_src} if args.before_src else {})}.items():
            env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
            proc = subprocess.run([sys.executable, __file__, "--child", str(model), str(Path(tmp) / name)], env=env,
                                  capture_output=True, text=True, timeout=3600, check=False)
            if proc.returncode != 0:
                raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            gather = out.get("weights/gather_peak_bytes")
            print(f"{name}: weights {weights_mib:.0f} MiB; driver peak above resident: building the trainer "
                  f"{out['build_mib']:.0f} MiB ({out['build_mib'] / weights_mib:.2f} copies), publishing a version "
                  f"{out['publish_mib']:.0f} MiB ({out['publish_mib'] / weights_mib:.2f} copies)"
                  + (f"; ranks' gather peak {gather / 2**20:.0f} MiB" if gather else "")
                  + "".join(f"; {k.split('/')[-1]} peak {v:.0f} MiB" for k, v in out.items()
                            if k.startswith("memory/")))


if __name__ == "__main__":
    main()
