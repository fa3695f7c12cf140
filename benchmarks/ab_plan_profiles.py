"""A/B of two planner versions against the same measured runs: profiles of both taken interleaved, then the six
runs of bench_plan, each predicted by both versions (each in its own src)."""
import json, os, subprocess, sys, tempfile
from pathlib import Path
TREES = {"base": Path("/tmp/plan-base"), "new": Path("/work/main")}
PY = "/work/main/.venv/bin/python"
sys.path.insert(0, "/work/main/benchmarks"); sys.path.insert(0, "/work/main/src")
import bench_plan as bp
from asyncflow.workflow.compare import train_run
import yaml

PREDICT = r'''
import json, sys
sys.path.insert(0, sys.argv[1] + "/benchmarks")
import bench_plan as bp
from asyncflow.plan.costs import Profile
a = json.loads(sys.argv[2])
print(bp.predict(Profile.load(a["profile"]), a["rows"], a["mode"], a["k"], steps=a["steps"], warmup=a["warmup"],
      group_size=a["g"], prompts=a["p"], max_new=a["m"], slots=a["s"], micro_batch=a["mb"]))
'''
def main():
    steps, warmup = 12, 2
    tmp = Path(tempfile.mkdtemp())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    profiles = {}
    for placement, overrides in {"inline": [], "ray": bp.SEPARATED}.items():
        for v, tree in TREES.items():
            path = tmp / f"profile_{v}_{placement}.yaml"
            subprocess.run([PY, "-m", "asyncflow.cli", "profile", str(tree / "examples/arithmetic_grpo.yaml"), *overrides,
                            "--threads", "1", "--out", str(path)], check=True, capture_output=True,
                           env=dict(env, PYTHONPATH=str(tree / "src")))
            profiles[v, placement] = path
            print(v, placement, json.dumps({k: round(x, 7) for k, x in yaml.safe_load(path.read_text()).items() if k in ("decode_row_s", "train_micro_batch_s", "train_token_s", "queue_call_s")}), flush=True)
    print("| workload | mode | measured | base pred | base err | new pred | new err | measured vs sync | base vs sync | new vs sync |")
    for name, overrides in bp.WORKLOADS.items():
        res = {}
        for mode, (mode_overrides, k) in bp.MODES.items():
            out = tmp / f"{len(res)}_{name[:4]}"
            rows = train_run([str(bp.ROOT / "examples/arithmetic_grpo.yaml"), *bp.COMMON, *overrides, *mode_overrides, f"train.steps={steps}"], out, threads=1, timeout_s=1800)
            measured = bp.window_step_s([r["wall_s"] for r in rows], warmup, k)
            cfg = yaml.safe_load((out / "config.yaml").read_text()); ro, tr = cfg["rollout"], cfg["train"]
            preds = {}
            for v, tree in TREES.items():
                a = dict(profile=str(profiles[v, "inline" if mode == "sync" else "ray"]), rows=rows, mode=mode, k=k, steps=steps, warmup=warmup,
                         g=ro["group_size"], p=ro["prompts_per_step"], m=ro["max_new_tokens"], s=ro["max_batch_size"], mb=tr["micro_batch_size"])
                r = subprocess.run([PY, "-c", PREDICT, str(tree), json.dumps(a)], capture_output=True, text=True, env=dict(env, PYTHONPATH=str(tree / "src")), check=True)
                preds[v] = float(r.stdout.strip().splitlines()[-1])
            res[mode] = (measured, preds)
            ms, ps = res["sync"]
            print(f"| {name} | {mode} | {measured:.3f} | {preds['base']:.3f} | {100*(preds['base']/measured-1):+.0f}% | {preds['new']:.3f} | {100*(preds['new']/measured-1):+.0f}% | {ms/measured:.2f}x | {ps['base']/preds['base']:.2f}x | {ps['new']/preds['new']:.2f}x |", flush=True)
main()
