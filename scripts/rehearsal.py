"""The rehearsal (docs/rehearsal.md): a run of CONFIG on a cluster of three `ray start` nodes on this machine
(a head and a trainer node offering `trainer_node`, a rollout node offering `rollout_node`, as
tests/runtime/test_multinode.py starts them), killed with SIGKILL once checkpoint `--kill-after` is written,
resumed with `--resume` to its last step, its final export loaded back through `AutoTokenizer` /
`AutoModelForCausalLM` only and checked against the last checkpoint's weights.

Checks, each an `AssertionError` naming what failed: every step logged once and every prompt trained exactly
once (the steps' group ids tile 0..N-1 in order), the staleness bound, the export's weights equal to the final
checkpoint's, the exported tokenizer's chat template renders the ChatML prompt and greedy decoding from the
export runs. Prints one JSON line: wall seconds of each run, the peak resident memory of each role (the runs'
`memory/peak_rss_mb/*` metrics) and the sizes on disk of a checkpoint and of the export.

    .venv-vllm/bin/python scripts/rehearsal.py                                # examples/rehearsal_0.5b.yaml
    .venv-vllm/bin/python scripts/rehearsal.py --kill-after 0 train.steps=2   # no kill, CONFIG overrides after
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))

from test_multinode import Cluster  # noqa: E402  (the multi-node test's `ray start` nodes)

EXAMPLE = ROOT / "examples" / "rehearsal_0.5b.yaml"
RUN_TIMEOUT_S = 3600.0


class ProcessPeaks:
    """Samples, every `period_s` from a thread of its own, the peak resident size (`VmHWM`) of every process
    descended from `roots` (the nodes' `ray start` processes: their actors, vLLM's engine core and workers), by
    process title: where a replica's weights and KV cache live (vLLM's worker process), which its actor's own
    `memory/peak_rss_mb/rollout_R` does not see."""

    def __init__(self, roots: list[int], period_s: float = 0.5):
        self.roots, self.period_s = set(roots), period_s
        self.peaks_kib: dict[tuple[int, str], int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        processes = {}  # pid -> (parent pid, peak KiB, title)
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
                title = (status.parent / "cmdline").read_bytes().split(b"\0")[0].decode()[:40]
                peak = int(fields["VmHWM"].split()[0]) if "VmHWM" in fields else 0
                processes[int(status.parent.name)] = (int(fields["PPid"]), peak, title)
            except (OSError, ValueError, KeyError):
                continue  # a process that ended meanwhile
        children: dict[int, list[int]] = {}
        for pid, (parent, _, _) in processes.items():
            children.setdefault(parent, []).append(pid)
        todo = [pid for pid in self.roots if pid in processes]
        while todo:
            pid = todo.pop()
            _, peak, title = processes[pid]
            self.peaks_kib[pid, title] = max(self.peaks_kib.get((pid, title), 0), peak)
            todo.extend(children.get(pid, []))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def stop(self) -> dict[str, int]:
        """Stop sampling; `title (pid)` -> peak MiB, for the processes that reached 100 MiB."""
        self._stop.set()
        self._thread.join()
        return {f"{title} ({pid})": kib // 1024 for (pid, title), kib in sorted(self.peaks_kib.items())
                if kib >= 100 * 1024}


def start_cluster(logs: Path) -> Cluster:
    """The multi-node test's three nodes (`Cluster.start_three_nodes`, which starts the whole cluster again when a
    node misses Ray's start limit or the head loses its port); stopped again if they do not come up."""
    cluster = Cluster(logs)
    try:
        cluster.start_three_nodes()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def train_command(config: Path, run_dir: Path, address: str, overrides: list[str], resume: bool) -> list[str]:
    return [sys.executable, "-m", "asyncflow.cli", "train", str(config), f"runtime.address={address}",
            *overrides, "--output", str(run_dir), "--threads", "2", *(["--resume"] if resume else [])]


def rows(run_dir: Path) -> list[dict[str, Any]]:
    text = (run_dir / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def run_and_kill(command: list[str], env: dict[str, str], checkpoint: Path, log: Path) -> float:
    """Start `command`, SIGKILL it once `checkpoint/state.json` exists; its wall seconds until the kill."""
    t0 = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while not (checkpoint / "state.json").exists():
                if process.poll() is not None:
                    raise AssertionError(f"the run ended (exit {process.returncode}) before {checkpoint}: see {log}")
                if time.monotonic() - t0 > RUN_TIMEOUT_S:
                    raise AssertionError(f"no {checkpoint} within {RUN_TIMEOUT_S:.0f} s: see {log}")
                time.sleep(0.05)
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=60)
    return time.monotonic() - t0


def run_to_end(command: list[str], env: dict[str, str], log: Path) -> float:
    t0 = time.monotonic()
    with open(log, "w") as out:
        done = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(command[3:6])}... exited {done.returncode}: see {log}")
    return time.monotonic() - t0


def check_exactly_once(steps: list[dict[str, Any]], prompts_per_step: int, max_staleness: int) -> None:
    """Steps 0..N logged once each; step s trained the prompts with group ids (s-1)*P .. s*P-1."""
    assert [r["step"] for r in steps] == list(range(len(steps))), [r["step"] for r in steps]
    for r in steps[1:]:
        first = (r["step"] - 1) * prompts_per_step
        got = (r["data/group_id_min"], r["data/group_id_max"], r["data/groups"])
        assert got == (first, first + prompts_per_step - 1, prompts_per_step), f"step {r['step']} trained {got}"
        assert r["staleness/max"] <= max_staleness, r


def check_export(export: Path, checkpoint: Path) -> None:
    """The export loads through the Auto classes alone, holds the checkpoint's weights, and generates."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    trained = load_file(str(checkpoint / "model.safetensors"))
    state = model.state_dict()
    for name, tensor in trained.items():
        assert torch.equal(state[name], tensor.to(state[name].dtype)), f"exported {name} differs from {checkpoint}"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "2+3="}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n"), prompt
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    tokens = tokenizer.convert_ids_to_tokens(ids[0].tolist())
    assert tokens.count("<|im_start|>") == prompt.count("<|im_start|>") == 3, f"a special token was split: {tokens}"
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids.shape[1]


def phase_seconds(run_dir: Path) -> dict[str, float]:
    """Seconds per step of the last run (its `timeline.json`): each kind of span's total over the run divided by
    the optimizer steps it took, and the median `time/step_s`."""
    import statistics
    from collections import Counter

    events = [e for e in json.loads((run_dir / "timeline.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    totals: Counter[str] = Counter()
    for event in events:
        totals[event["name"]] += event["dur"] / 1e6
    steps = sum(1 for e in events if e["name"] == "optimizer_step")
    seconds = {name: total / max(steps, 1) for name, total in totals.items()}
    seconds["step_median"] = statistics.median(r["time/step_s"] for r in rows(run_dir) if "time/step_s" in r)
    return {name: round(value, 3) for name, value in sorted(seconds.items())}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def rehearse(config: Path, overrides: list[str], run_dir: Path, kill_after: int) -> dict[str, Any]:
    """Start the cluster, run (killed after checkpoint `kill_after` and resumed, unless it is 0), check; the
    summary (see the module docstring)."""
    from asyncflow.config import load_config

    settings = load_config(str(config), overrides)
    steps = settings.train.steps
    assert 0 <= kill_after < steps, f"--kill-after must be below train.steps ({steps})"
    run_dir.mkdir(parents=True, exist_ok=True)
    cluster = start_cluster(run_dir)
    sampler = ProcessPeaks([p.pid for p in cluster.nodes.values()])
    t0 = time.monotonic()
    try:
        env = cluster.env
        walls = {}
        if kill_after:
            walls["killed_run_s"] = run_and_kill(train_command(config, run_dir / "run", cluster.address, overrides,
                                                               False),
                                                 env, run_dir / "run" / "checkpoints" / f"step_{kill_after}",
                                                 run_dir / "killed.log")
        walls["run_s"] = run_to_end(train_command(config, run_dir / "run", cluster.address, overrides,
                                                  bool(kill_after)), env, run_dir / "run.log")
    finally:
        processes = sampler.stop()
        cluster.stop()
    steps_logged = rows(run_dir / "run")
    check_exactly_once(steps_logged, settings.rollout.prompts_per_step, settings.workflow.max_staleness)
    assert steps_logged[-1]["step"] == steps
    last = run_dir / "run" / "checkpoints" / f"step_{steps}"
    check_export(run_dir / "run" / "export", last)
    peaks: dict[str, float] = {}
    for row in steps_logged:
        for key, value in row.items():
            if key.startswith("memory/peak_rss_mb/"):
                role = key.rsplit("/", 1)[1]
                peaks[role] = max(peaks.get(role, 0.0), value)
    return {"steps": steps, "killed_after_checkpoint": kill_after, **{k: round(v, 1) for k, v in walls.items()},
            "wall_s": round(time.monotonic() - t0, 1), "peak_rss_mb": {k: round(v) for k, v in peaks.items()},
            "process_peak_mb": processes,
            "seconds_per_step": phase_seconds(run_dir / "run"),
            "weights_gather_peak_mb": round(max(r.get("weights/gather_peak_bytes", 0) for r in steps_logged) / 2**20,
                                            1),
            "checkpoint_mb": round(folder_bytes(last) / 2**20, 1),
            "export_mb": round(folder_bytes(run_dir / "run" / "export") / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="CONFIG overrides (section.key=value)")
    parser.add_argument("--config", type=Path, default=EXAMPLE)
    parser.add_argument("--kill-after", type=int, default=1, help="SIGKILL after this checkpoint (0: no kill)")
    parser.add_argument("--output", type=Path, help="folder of the run and its logs (default: a temporary one)")
    args = parser.parse_args()
    output = args.output or Path(tempfile.mkdtemp(prefix="rehearsal-"))
    print(json.dumps(rehearse(args.config, args.overrides, output, args.kill_after)))


if __name__ == "__main__":
    main()
