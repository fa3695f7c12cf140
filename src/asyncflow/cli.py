"""Command line: `asyncflow train | sft | eval | bench`.

Owns: argument parsing, logging set-up, and turning config errors into a clear message and a
non-zero exit before any work starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from asyncflow.config import Config, ConfigError, load_config

log = logging.getLogger("asyncflow")


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML config file (defaults are used for missing keys)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4 rollout.group_size=4")
    parser.add_argument("--output", help="run folder (overrides run.output_dir)")
    parser.add_argument(
        "--threads", type=int, default=0,
        help="torch CPU threads (0 = torch's default, one per core). On a CPU shared with other jobs, 1 avoids "
        "the large slow-downs of oversubscribed OpenMP threads; tiny models gain little from more.",
    )


def _config(args) -> Config:
    overrides = list(args.overrides)
    if args.config and "=" in args.config:  # no file given, only overrides
        overrides.insert(0, args.config)
        args.config = None
    if args.output:
        overrides.append(f"run.output_dir={args.output}")
    return load_config(args.config, overrides)


def sft_output(config: Config) -> Path:
    return Path(config.sft.output or Path(config.run.output_dir) / "sft")


def cmd_train(args) -> int:
    config = _config(args)
    from asyncflow.workflow import make_workflow
    from asyncflow.workflow.run import RLRun
    from asyncflow.workflow.sft import read_summary, run_sft

    sft = {}
    if config.sft.before_rl:
        out = sft_output(config)
        if not (out / "config.json").exists():
            run_sft(config, out)
        summary = read_summary(out) or {}
        sft = {"sft/steps": summary.get("steps"), "sft/val_accuracy": summary.get("val_accuracy")}
        log.info("RL starts from the SFT model in %s (SFT steps %s, validation accuracy %s)",
                 out, sft["sft/steps"], sft["sft/val_accuracy"])
        config = config.model_copy(update={"model": config.model.model_copy(update={"path": str(out)})})
    run = RLRun(config, resume=args.resume)
    history = run.train(make_workflow(config, run))
    final = {k: v for k, v in history[-1].items() if k.startswith(("eval/", "reward/mean"))}
    print(json.dumps({"run_dir": str(run.run_dir), "step": run.step, **final, **sft}))
    return 0


def cmd_sft(args) -> int:
    config = _config(args)
    from asyncflow.workflow.sft import read_summary, run_sft

    out = run_sft(config, sft_output(config))
    summary = read_summary(out) or {}
    print(json.dumps({"sft_model": str(out),
                      "steps": summary.get("steps"), "val_accuracy": summary.get("val_accuracy")}))
    return 0


def cmd_eval(args) -> int:
    config = _config(args)
    from asyncflow.workflow.checkpoint import load_weights
    from asyncflow.workflow.run import RLRun

    checkpoint = Path(args.checkpoint)
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"checkpoint folder {str(checkpoint)!r} does not exist (expected RUN_DIR/checkpoints/step_N)")
    weights = load_weights(checkpoint)
    eval_dir = Path(config.run.output_dir) / "eval"
    run = RLRun(config.model_copy(update={"run": config.run.model_copy(update={"output_dir": str(eval_dir)})}))
    run.train_engine.model.load_state_dict(weights)  # `evaluate` reads the policy's weights
    result = run.evaluate()
    run.metrics.close()
    print(json.dumps({"checkpoint": args.checkpoint, **result}))
    return 0


def cmd_bench(args) -> int:
    config = _config(args)
    from asyncflow.workflow.bench import run_benchmark

    run_benchmark(config, modes=args.modes, repeats=args.repeats)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncflow", description="Asynchronous streaming RL post-training of language models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="RL training (GRPO, PPO, ...) in the configured workflow")
    _add_common(train)
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the run folder")
    train.set_defaults(func=cmd_train)

    sft = sub.add_parser("sft", help="supervised warm-up on (prompt, answer) pairs")
    _add_common(sft)
    sft.set_defaults(func=cmd_sft)

    ev = sub.add_parser("eval", help="held-out accuracy of a checkpoint")
    _add_common(ev)
    ev.add_argument("--checkpoint", required=True, help="checkpoint folder (RUN_DIR/checkpoints/step_N)")
    ev.set_defaults(func=cmd_eval)

    bench = sub.add_parser("bench", help="compare workflows side by side on one workload")
    _add_common(bench)
    bench.add_argument("--modes", nargs="+", default=["sync", "stream", "async1", "async2"])
    bench.add_argument("--repeats", type=int, default=1)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = list(getattr(args, "overrides", [])) + extra
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if getattr(args, "threads", 0) > 0:
        import torch

        torch.set_num_threads(args.threads)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"asyncflow: {err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as err:
        print(f"asyncflow: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
