"""asyncflow from Python: a short GRPO run on the built-in arithmetic task, a user stage adding a second reward,
then a loop of one's own in the workflow's verbs. Run from the repository root:

    .venv/bin/python examples/python_api.py

It takes a few minutes on a laptop CPU and writes runs/python_api/ and runs/python_api_own/.
"""

from __future__ import annotations

import sys
from pathlib import Path

import asyncflow
from asyncflow.workers.stage import StageBatch

sys.path.insert(0, str(Path(__file__).parent))  # so the stage below can be named as "python_api:brevity"


def brevity(batch: StageBatch) -> dict[str, list[float]]:
    """A second reward, computed from the response as rows arrive: shorter answers score higher."""
    return {"brevity": [1.0 / (1 + len(ids)) for ids in batch.columns["response_ids"]]}


def main() -> None:
    config = asyncflow.load_config("examples/arithmetic_grpo.yaml", [
        "run.output_dir=runs/python_api", "train.steps=20", "eval.every=10", "data.test_size=64",
        "stages=[{name: brevity, fn: 'python_api:brevity', inputs: [response_ids], outputs: [brevity]}]",
        "reward.columns={brevity: 0.1}",
    ])

    def show(row: dict) -> None:
        if "eval/accuracy" in row:
            print(f"step {row['step']:3d}  held-out accuracy {row['eval/accuracy']:.3f}")

    result = asyncflow.train(config, overwrite=True, on_step=show)
    print("run folder:", result.run_dir, "| SFT:", result.sft)
    checkpoint = result.run_dir / "checkpoints" / f"step_{result.step}"
    print("its last checkpoint, evaluated again:", asyncflow.evaluate(config, checkpoint))

    # A loop of one's own, in the verbs the built-in workflows are written in (`sync` here), from the SFT model.
    own = asyncflow.load_config("examples/arithmetic_grpo.yaml", [
        "run.output_dir=runs/python_api_own", f"model.path={result.run_dir / 'sft'}", "sft.before_rl=false",
    ])
    with asyncflow.open_run(own, overwrite=True) as run:  # claimed, checked and built as `train` does; closed after
        flow = run.workflow
        flow.start(step=0, version=0)
        for step in range(3):
            flow.put_prompts(step)
            flow.generate(step)
            for rows in flow.experience(step, version=step):
                run.trainer.accumulate(rows, policy_version=step)  # look at, filter or reweight the rows first
            metrics = run.trainer.finish_step()
            flow.publish(step + 1)
            print(f"own loop, step {step}: loss {metrics['loss']:.4f}, gradient norm {metrics['grad_norm']:.3f}")


if __name__ == "__main__":
    main()
