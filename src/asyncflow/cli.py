"""Command line: `asyncflow train | sft | eval | export | bench | serve | profile | plan`.

Owns: argument parsing, logging set-up, the order of a command's work, and turning errors into
one line and an exit code.

Invariants:
- `train` and `eval` check everything the config alone decides (`preflight`: reward spec, data,
  prompt lengths) before the run folder is written and before any model loads; `train` settles
  what to do with the run folder (`RunFolder.plan`) before that, reading only.
- Exit codes: 0 done (a finished run resumed included), 2 a config error (bad key or value, a run
  folder in use without `--resume` / `--overwrite` or locked by another process, a resume that
  changes its data or a fixed setting), 1 any other error the user can act on (a missing or damaged
  file, bad data, a full disk, a read-only folder, a Ray cluster that does not start), 130 / 143
  stopped by SIGINT / SIGTERM after a final checkpoint; each one line on stderr (`-v` adds the
  traceback).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from pydantic import ValidationError

from asyncflow.config import Config, ConfigError, load_config
from asyncflow.rewards import RewardHealthError, RewardStuckError
from asyncflow.workflow.stopping import RunStopped, StoppedAtOnce

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


def cmd_train(args) -> int:
    from asyncflow import api

    result = api.train(_config(args), resume=args.resume, overwrite=args.overwrite,
                       accept_data_change=args.accept_data_change)
    if result.finished_before:
        print(json.dumps({"run_dir": str(result.run_dir), "step": result.step, "finished": True}))
        return 0
    final = {k: v for k, v in result.history[-1].items() if k.startswith(("eval/", "reward/mean"))}
    print(json.dumps({"run_dir": str(result.run_dir), "step": result.step, **final, **result.sft}))
    return 0


def cmd_sft(args) -> int:
    from asyncflow import api

    summary = api.sft(_config(args))
    print(json.dumps({k: summary.get(k) for k in ("sft_model", "steps", "val_accuracy")}))
    return 0


def cmd_eval(args) -> int:
    from asyncflow import api

    result = api.evaluate(_config(args), args.checkpoint)
    shown = {name: None if isinstance(value, float) and math.isnan(value) else value  # no score: null, as JSON has
             for name, value in result.items()}
    print(json.dumps({"checkpoint": args.checkpoint, **shown}))
    return 0


def cmd_export(args) -> int:
    from asyncflow import api

    out = api.export(args.run_dir, args.out, step=args.checkpoint, merged=args.merged)
    print(json.dumps({"export": str(out), **json.loads((out / "asyncflow_export.json").read_text())}))
    return 0


def cmd_bench(args) -> int:
    config = _config(args)  # validated here, before any run starts
    from asyncflow.workflow.compare import compare, mode_overrides

    for mode in args.modes:
        mode_overrides(mode)
    base_args = [a for a in (args.config, *args.overrides) if a]
    result = compare(
        base_args,
        args.modes,
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
        threads=args.threads,
        sft_first=config.sft.before_rl,
    )
    print(json.dumps(result))
    return 0


def cmd_serve(args) -> int:
    import os

    if args.overrides:
        raise ConfigError(f"asyncflow serve takes no config overrides: {' '.join(args.overrides)}")
    from asyncflow.serving.limits import ServingLimits

    try:
        limits = ServingLimits(**{key: getattr(args, key) for key in ServingLimits.model_fields
                                  if getattr(args, key) is not None})
    except ValidationError as err:  # name the flag
        first = err.errors()[0]
        raise ConfigError(f"--{str(first['loc'][0]).replace('_', '-')}: {first['msg']}") from None
    given_key = args.api_key
    if args.api_key:
        log.warning("--api-key shows in the process list (ps): prefer --api-key-file or $ASYNCFLOW_API_KEY")
    if args.api_key_file:
        given_key = Path(args.api_key_file).read_text().strip()
        if not given_key:
            raise ConfigError(f"--api-key-file {args.api_key_file}: the file is empty")
    given_key = given_key or os.environ.get("ASYNCFLOW_API_KEY")
    from asyncflow import api

    chat_template = Path(args.chat_template).read_text() if args.chat_template else None
    api.serve(
        args.model, host=args.host, port=args.port, api_key=given_key, name=args.name, engine=args.engine,
        max_batch_size=args.max_batch_size, device=args.device, dtype=args.dtype, seed=args.seed,
        chat_template=chat_template, request_timeout_s=args.request_timeout, limits=limits, port_file=args.port_file,
        replicas=args.replicas,
    )
    return 0


def _port(text: str) -> int:
    port = int(text) if text.isdigit() else -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0-65535)")
    return port


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncflow", description="Asynchronous streaming RL post-training of language models."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="RL training (GRPO, PPO, ...) in the configured workflow")
    _add_common(train)
    given = train.add_mutually_exclusive_group()
    given.add_argument(
        "--resume", action="store_true",
        help="continue the run in the run folder from its newest intact checkpoint (a finished run: write the "
        "outputs it is missing)",
    )
    given.add_argument(
        "--overwrite", action="store_true", help="delete the run in the run folder (SFT model included), start again"
    )
    train.add_argument(
        "--accept-data-change", action="store_true",
        help="--resume on training data that changed since the checkpoint, from the checkpoint's data position",
    )
    train.set_defaults(func=cmd_train)

    sft = sub.add_parser("sft", help="supervised warm-up on (prompt, answer) pairs")
    _add_common(sft)
    sft.set_defaults(func=cmd_sft)

    ev = sub.add_parser("eval", help="held-out accuracy of a checkpoint or a model")
    _add_common(ev)
    ev.add_argument("--checkpoint", required=True, help="a checkpoint folder RUN_DIR/checkpoints/step_N (on its "
                    "run's base model), a run folder (its newest checkpoint), a Hugging Face model folder or "
                    "preset:NAME")
    ev.set_defaults(func=cmd_eval)

    export = sub.add_parser("export", help="write a run's policy as a Hugging Face folder (transformers, vLLM)")
    export.add_argument("run_dir", help="run folder (run.output_dir)")
    export.add_argument("out", help="new folder to write (must not exist or be empty)")
    export.add_argument("--checkpoint", type=int, metavar="STEP", help="checkpoint step (default: newest intact)")
    export.add_argument("--merged", action="store_true",
                        help="LoRA runs: also write the merged full model (the adapter goes to OUT/adapter)")
    export.set_defaults(func=cmd_export)

    bench = sub.add_parser("bench", help="train one config in several workflow modes and compare samples/s")
    _add_common(bench)
    bench.add_argument("--modes", nargs="+", default=["sync", "stream", "async:1"], help="sync, stream, async:K")
    bench.add_argument("--steps", type=int, default=10, help="training steps per run")
    bench.add_argument("--warmup", type=int, default=2, help="steps left out of the throughput window")
    bench.add_argument("--repeats", type=int, default=1)
    bench.set_defaults(func=cmd_bench)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over a model, a run or a checkpoint")
    serve.add_argument("model", help="a Hugging Face model folder, preset:NAME, a run folder (its newest checkpoint) "
                       "or a checkpoint folder RUN_DIR/checkpoints/step_N")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    serve.add_argument("--port", type=_port, default=8000, help="TCP port (0: a free one, printed; see --port-file)")
    serve.add_argument("--port-file", help="write the port, once the server accepts connections, to this file "
                       "(whole, one line): how a script finds the port of --port 0")
    serve.add_argument("--api-key", help="the Bearer key clients must send (visible in ps: prefer --api-key-file or "
                       "$ASYNCFLOW_API_KEY; without any, a generated one, printed; required off loopback)")
    serve.add_argument("--api-key-file", help="a file holding the Bearer key (its first line)")
    serve.add_argument("--name", help="the model name clients ask for (default: the preset, folder or run/step)")
    serve.add_argument("--chat-template", help="a Jinja chat template file, for tokenizers without one")
    serve.add_argument("--engine", default="torch", help="inference engine from the registry (or module:factory)")
    serve.add_argument("--max-batch-size", type=int, default=64, help="concurrent sequences in the engine")
    serve.add_argument("--replicas", type=int, default=1, help="engines, each with its own copy of the weights, "
                       "behind a router that keeps a session (an episode, the request's `user`) on one replica")
    serve.add_argument("--device", default="cpu")
    serve.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    serve.add_argument("--seed", type=int, default=0, help="the engine's sampling seed")
    serve.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request gets 504")
    serve.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    from asyncflow.serving.limits import ServingLimits

    for key, field in ServingLimits.model_fields.items():  # one flag per limit (docs/serving-limits.md)
        serve.add_argument(f"--{key.replace('_', '-')}", dest=key, type=cast("Callable[[str], Any]", field.annotation),
                           default=None, help=f"{field.description} (default {field.default})")
    serve.set_defaults(func=cmd_serve)

    from asyncflow.plan.commands import add_commands  # `profile` and `plan` (docs/planning.md)

    add_commands(sub, _add_common, _config)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = list(getattr(args, "overrides", [])) + extra
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if getattr(args, "threads", 0) > 0:
        import torch

        torch.set_num_threads(args.threads)
    try:
        return args.func(args)
    except RunStopped as err:
        print(f"asyncflow: {err}", file=sys.stderr)
        return err.exit_code
    except StoppedAtOnce as err:
        print(f"asyncflow: {err}", file=sys.stderr)
        # The run's `finally` blocks have run; threads it left (a generation, a reward call) may still be inside
        # torch, and finalising the interpreter under them can abort it ("PyThreadState_Get ... the GIL is
        # released", SIGABRT instead of the exit code): a stop at once skips finalisation.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(err.exit_code)
    except ConfigError as err:
        log.debug("config error", exc_info=True)
        print(f"asyncflow: {err}", file=sys.stderr)
        return 2
    # OSError: a full disk, a read-only folder, Ray not starting, ...; the reward errors: a broken reward function
    except (OSError, ValueError, RewardHealthError, RewardStuckError) as err:
        log.debug("error", exc_info=True)
        print(f"asyncflow: error: {_one_line(err)}", file=sys.stderr)
        return 1


def _one_line(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror and err.filename:  # e.g. [Errno 28] ... without the noise
        return f"{err.strerror}: {err.filename}"
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0] if isinstance(err, OSError) else text


if __name__ == "__main__":
    sys.exit(main())
