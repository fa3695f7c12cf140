"""The `asyncflow profile` and `asyncflow plan` commands (their parsers and what they run).

Owns: `add_commands(sub, add_common, load)`: the two subparsers, added by `asyncflow.cli`, which passes its own
config loader so that `profile` reads a config exactly as `train` does.

`asyncflow profile [CONFIG] [overrides] --out FILE`: measures this machine's costs for the config's model
(`asyncflow.plan.measure`), writes them (YAML, or JSON for a `.json` name) and prints them.
`asyncflow plan [SPEC.yaml] [key=value ...] --out DIR`: a `PlanSpec` from the file and dotted overrides
(`devices=64 workload.response.kind=lognormal workload.response.mean=4000`), `--from-run RUN_DIR` takes the
response lengths from a run's metrics; prints the predictions table and writes the recommended setting's
simulated `timeline.json` / `timeline.png` and `plan.md` in DIR.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from asyncflow.config import Config
    from asyncflow.plan.planner import PlanSpec

LoadConfig = Callable[[argparse.Namespace], "Config"]  # the CLI's config from its arguments


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        data = data.setdefault(key, {})
    data[last] = value


def plan_spec(path: str | None, overrides: list[str], from_run: str | None = None) -> PlanSpec:
    from asyncflow.plan.planner import PlanSpec
    from asyncflow.plan.workload import lengths_from_run

    data = yaml.safe_load(Path(path).read_text()) if path else {}
    for item in overrides:
        key, _, value = item.partition("=")
        _set(data, key, yaml.safe_load(value))
    if from_run:
        _set(data, "workload.response", lengths_from_run(from_run).model_dump())
    return PlanSpec.model_validate(data)


def cmd_profile(args: argparse.Namespace, load: LoadConfig) -> int:
    from asyncflow.plan.measure import measure_profile

    profile = measure_profile(load(args), repeats=args.repeats, name=args.name)
    path = profile.save(args.out)
    print(json.dumps({"profile": str(path), **profile.model_dump(exclude={"notes", "hardware"})}, indent=1))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from asyncflow.plan.planner import plan, render, write_outputs

    config = args.config if args.config and "=" not in args.config else None
    overrides = ([args.config] if args.config and "=" in args.config else []) + list(args.overrides)
    spec = plan_spec(config, overrides, args.from_run)
    predictions = plan(spec)
    table = render(predictions)
    print(table)
    if args.out:
        best = min(predictions, key=lambda p: p.step_s)
        files = write_outputs(best, args.out)
        Path(args.out, "plan.md").write_text(f"```yaml\n{yaml.safe_dump(spec.model_dump(), sort_keys=False)}```\n\n"
                                             f"{table}\n")
        print("wrote", ", ".join(str(f) for f in files), "and", Path(args.out, "plan.md"))
    return 0


def add_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    add_common: Callable[[argparse.ArgumentParser], None],
    load: LoadConfig,
) -> None:
    profile = sub.add_parser("profile", help="measure this machine's cost functions for a config's model")
    add_common(profile)
    profile.add_argument("--out", default="profile.yaml", help="profile file to write (.yaml or .json)")
    profile.add_argument("--repeats", type=int, default=5, help="timings per point (the median is kept)")
    profile.add_argument("--name", default="", help="the profile's name (default: this host's)")
    profile.set_defaults(func=lambda args: cmd_profile(args, load))

    plan = sub.add_parser("plan", help="predict step time and device split of sync / stream / async on a cluster")
    plan.add_argument("config", nargs="?", help="a plan spec YAML (asyncflow.plan.planner.PlanSpec)")
    plan.add_argument("overrides", nargs="*", help="dotted overrides, e.g. devices=64 model=32B profile=a100")
    plan.add_argument("--from-run", help="take response lengths from this run folder's metrics.jsonl")
    plan.add_argument("--out", help="folder for the simulated timeline.json / timeline.png and plan.md")
    plan.set_defaults(func=cmd_plan)
