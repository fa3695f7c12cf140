"""How often following the config from `asyncflow.api.train` enters each module of asyncflow.

A `sys.setprofile` tracer (on every thread) watches a two-step SFT warm-up and a one-step `sync` RL run of the tiny
preset (the main job's path): a call *enters* a module when the function called is in an asyncflow module other than
its caller's and is handed the config (an argument, `self` included, that is the `Config` or one of its sections).
Generator frames count once, at their first call, not at each resume. `asyncflow.config` itself is not counted (its
methods are the config's own).

Prints `module count`, most entered first; exits 1 when a module is entered more than `--max` times (the design
goal: 5). Run from the repository root:

    PYTHONPATH=$PWD/src python scripts/config_trace.py [--max 5] [key=value ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from collections import Counter
from types import FrameType
from typing import Any

from pydantic import BaseModel

RUN = ["run.progress=false", "model.path=preset:tiny-llama", "workflow.mode=sync", "rollout.prompts_per_step=2",
       "rollout.group_size=2", "rollout.max_new_tokens=4", "train.steps=1", "train.micro_batch_size=4",
       "eval.every=0", "data.test_size=2", "checkpoint.every=0", "observe.tensorboard=false", "export.at_end=false",
       "sft.before_rl=true", "sft.steps=2", "sft.stop_accuracy=null"]  # the main job's path: SFT, then RL


def _is_config(value: object) -> bool:
    return isinstance(value, BaseModel) and type(value).__module__ == "asyncflow.config"


def _module(frame: FrameType | None) -> str:
    return frame.f_globals.get("__name__", "") if frame is not None else ""


class ConfigTracer:
    """Counts, per asyncflow module, the calls into it from another module that are handed the config."""

    def __init__(self) -> None:
        self.entries: Counter[str] = Counter()
        self.functions: Counter[str] = Counter()  # module.function -> entries
        self._generators: set[int] = set()  # frames of generators already counted (a resume is a "call" too)
        self._lock = threading.Lock()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        module = _module(frame)
        if not module.startswith("asyncflow.") or module == "asyncflow.config" or _module(frame.f_back) == module:
            return
        code = frame.f_code
        if code.co_flags & 0x2A0:  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR
            if id(frame) in self._generators:
                return
            self._generators.add(id(frame))
        arguments = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if any(_is_config(frame.f_locals.get(name)) for name in arguments):
            with self._lock:
                self.entries[module] += 1
                self.functions[f"{module}.{getattr(code, 'co_qualname', code.co_name)}"] += 1  # 3.11+: with class

    def __enter__(self) -> ConfigTracer:
        threading.setprofile(self)
        sys.setprofile(self)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max", type=int, default=5, help="most entries allowed per module")
    parser.add_argument("--functions", action="store_true", help="also print each function entered")
    parser.add_argument("overrides", nargs="*", help="config keys over the one-step run's (key=value)")
    args = parser.parse_args(argv)
    import asyncflow

    with tempfile.TemporaryDirectory() as out:
        config = asyncflow.build_config({}, [f"run.output_dir={out}", *RUN, *args.overrides])
        with ConfigTracer() as tracer:
            asyncflow.train(config)
    for module, count in tracer.entries.most_common():
        print(f"{module} {count}")
    if args.functions:
        for function, count in sorted(tracer.functions.items()):
            print(f"  {function} {count}")
    over = {m: c for m, c in tracer.entries.items() if c > args.max}
    if over:
        print(f"over {args.max}: {over}", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
