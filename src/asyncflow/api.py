"""The Python interface: configs, training, SFT, evaluation and export as functions; the CLI is a thin layer
over them.

    import asyncflow

    config = asyncflow.load_config("examples/arithmetic_grpo.yaml", ["train.steps=20", "run.output_dir=runs/nb"])
    result = asyncflow.train(config, overwrite=True, on_step=lambda row: print(row["step"], row["reward/mean"]))
    print(result.history[-1]["eval/accuracy"], result.run_dir)

Invariants: a function here does what the command of the same name does, with the same checks in the same order
(`preflight` before the run folder is touched), the same outputs and the same errors (a `ConfigError` or a
`ValueError` naming the key, file or line); an interrupted `train` (Ctrl-C in a notebook) stops the run's
workers and leaves the folder resumable with `resume=True`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from asyncflow.config import Config, ConfigError

log = logging.getLogger("asyncflow")

StepCallback = Callable[[dict], None]
"""Called with each metrics row as it is logged (`step`, `reward/mean`, `loss`, `eval/accuracy` ...)."""


@dataclass
class TrainResult:
    """What `train` did: the run folder, the metrics rows it logged (empty when the run was already finished),
    the step it ended at, and the SFT warm-up's summary (`sft/steps`, `sft/val_accuracy`) when it ran one."""

    run_dir: Path
    step: int
    history: list[dict] = field(default_factory=list)
    sft: dict = field(default_factory=dict)
    finished_before: bool = False


def sft_output(config: Config) -> Path:
    """Where SFT writes its model: `sft.output`, else `RUN_DIR/sft`."""
    return Path(config.sft.output or Path(config.run.output_dir) / "sft")


def train(config: Config, *, resume: bool = False, overwrite: bool = False, on_step: StepCallback | None = None
          ) -> TrainResult:
    """RL training as `asyncflow train`: settle the run folder (`resume` / `overwrite` a run already there),
    check the input, run the SFT warm-up when `sft.before_rl` asks for it, then train `train.steps` steps in
    the configured workflow. `on_step` sees every metrics row as it is logged."""
    from asyncflow.workflow.run import RLRun
    from asyncflow.workflow.run_folder import RunFolder
    from asyncflow.workflow.setup import preflight
    from asyncflow.workflow.sft import read_summary, run_sft

    folder = RunFolder(config.run.output_dir)
    plan = folder.plan(steps=config.train.steps, resume=resume, overwrite=overwrite)
    if plan.action == "finished":
        log.info("the run in %s is already finished (checkpoint %s, train.steps=%d): nothing to do",
                 folder.path, plan.checkpoint, config.train.steps)
        return TrainResult(folder.path, plan.step, finished_before=True)
    checked = preflight(config)
    folder.prepare(plan)
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
    run = RLRun(config, plan=plan, checked=checked, on_step=on_step)
    history = run.train()
    return TrainResult(run.run_dir, run.step, history, sft)


def sft(config: Config, output: str | Path | None = None) -> dict:
    """The SFT warm-up alone, as `asyncflow sft`; -> its summary (`steps`, `val_accuracy` ...) with `sft_model`."""
    from asyncflow.workflow.sft import read_summary, run_sft

    out = run_sft(config, Path(output) if output is not None else sft_output(config))
    return {"sft_model": str(out), **(read_summary(out) or {})}


def evaluate(config: Config, checkpoint: str | Path) -> dict[str, float]:
    """Held-out accuracy of a checkpoint (`RUN_DIR/checkpoints/step_N`), as `asyncflow eval`: an inference engine
    and the run's rewards only, no trainer."""
    from asyncflow.workflow.evaluation import evaluate_checkpoint
    from asyncflow.workflow.setup import preflight

    checked = preflight(config, training=False)
    return evaluate_checkpoint(config, Path(checkpoint), checked.test_set)


def export(run_dir: str | Path, out: str | Path, *, step: int | None = None, merged: bool = False) -> Path:
    """A run's policy as a Hugging Face folder, as `asyncflow export` (`step`: default the newest intact
    checkpoint; `merged`: LoRA runs also write the merged model)."""
    from asyncflow.workflow.export import export_run

    return export_run(run_dir, out, step=step, merged=merged)


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          name: str | None = None, engine: str = "torch", max_batch_size: int = 64, device: str = "cpu",
          dtype: str = "float32", seed: int = 0, chat_template: str | None = None, request_timeout_s: float = 600.0,
          limits=None) -> None:
    """An OpenAI-compatible server over `model` (a Hugging Face folder, `preset:NAME`, a run folder or a checkpoint
    folder), as `asyncflow serve`; blocks until interrupted. Without `api_key` one is generated and printed; a
    host reachable from other machines needs one. `limits`: a `ServingLimits` (defaults otherwise)."""
    import secrets

    from asyncflow.workflow.serve import build_app, load_served

    try:
        from asyncflow.serving.limits import ServingLimits
        from asyncflow.serving.server import serve_forever
    except ImportError as err:
        raise ValueError(f"asyncflow serve needs the serve extra (pip install 'asyncflow-rl[serve]'): {err}") from None
    limits = limits or ServingLimits()
    if not _is_loopback(host):
        if not api_key:
            raise ConfigError(f"--host {host} is reachable from other machines: give the key clients must send "
                              "(--api-key-file FILE or $ASYNCFLOW_API_KEY), or serve on 127.0.0.1")
        log.warning("serving on %s, reachable from other machines: anyone who can reach it and holds the key can "
                    "use the model", host)
    _check_can_listen(host, port)
    key = api_key or secrets.token_urlsafe(24)
    weights = load_served(model, dtype=dtype, device=device)
    app, service = build_app(
        weights, api_key=key, name=name, engine=engine, max_batch_size=max_batch_size, device=device, seed=seed,
        chat_template=chat_template, request_timeout_s=request_timeout_s, limits=limits,
    )
    if not api_key:
        print(f"API key (generated): {key}", flush=True)
    print(f"serving {name or weights.name!r} at http://{host}:{port}/v1", flush=True)
    try:
        serve_forever(app, host=host, port=port, limits=limits)
    finally:
        service.close()


def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def _check_can_listen(host: str, port: int) -> None:
    """Bind `host:port` once before loading the model, so a port in use fails at once in one line."""
    import socket

    try:
        with socket.create_server((host, port)):
            pass
    except OSError as err:
        raise ConfigError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
