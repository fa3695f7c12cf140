"""`asyncflow plan` end to end on a small spec: the table, the recommendation, a simulated timeline that the real
timeline reader loads, and `--from-run` taking response lengths from a run's metrics."""

import json

import yaml

from asyncflow.cli import main
from asyncflow.observe import Timeline
from asyncflow.plan.workload import Lengths


def test_plan_writes_a_table_and_a_timeline(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(json.dumps({"step": i, "response_length/mean": 900.0,
                                                             "response_length/max": 4000}) for i in range(3)))
    out = tmp_path / "plan"
    code = main(["plan", "model=1.5B", "profile=a100", "devices=16", "steps=4", "splits=3", "staleness=[1]",
                 "workload.prompts_per_step=16", "--from-run", str(run), "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    for mode in ("| sync |", "| stream |", "| async k=1 |", "| async k=1 +partial |", "recommended:"):
        assert mode in text
    timeline = Timeline.from_chrome_trace(out / "timeline.json")
    assert {"trainer", "rollout"} <= set(timeline.workers())
    assert (out / "timeline.png").stat().st_size > 0 and "lognormal" not in (out / "plan.md").read_text()
    spec = yaml.safe_load((out / "plan.md").read_text().split("```yaml\n")[1].split("```")[0])
    assert Lengths.model_validate(spec["workload"]["response"]) == Lengths.truncated_geometric(900.0, 4000)
