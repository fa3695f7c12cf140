"""The Python interface: configs, training, SFT, evaluation and export as functions; the CLI is a thin layer
over them.

    import asyncflow

    config = asyncflow.load_config("examples/arithmetic_grpo.yaml", ["train.steps=20", "run.output_dir=runs/nb"])
    result = asyncflow.train(config, overwrite=True, on_step=lambda row: print(row["step"], row["reward/mean"]))
    print(result.history[-1]["eval/accuracy"], result.run_dir)

Invariants: a function here does what the command of the same name does, with the same checks in the same order
(`preflight` before the run folder is touched), the same outputs and the same errors (a `ConfigError` or a
`ValueError` naming the key, file or line). A function that writes into a run folder holds its lock
(`RunFolder.claim`) while it runs. `train` interrupted by SIGINT / SIGTERM (Ctrl-C, in a notebook too) stops
after the step in progress with a checkpoint and raises `RunStopped`; the folder is resumable with
`resume=True`.

One way into a run: `train` and `open_run` claim and settle the folder (`_settled`), then check the input, carry
the plan out, warm up and build the `RLRun` (`_start`); nothing else builds one, so a run started either way holds
the same lock, checks and outputs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from asyncflow.config import Config, ConfigError

if TYPE_CHECKING:
    from asyncflow.workflow.run import RLRun
    from asyncflow.workflow.run_folder import Plan
    from asyncflow.workflow.stopping import StopSignals

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


def train(config: Config, *, resume: bool = False, overwrite: bool = False, on_step: StepCallback | None = None,
          accept_data_change: bool = False) -> TrainResult:
    """RL training as `asyncflow train`: claim the run folder and settle it (`resume` / `overwrite` a run already
    there), check the input, run the SFT warm-up when `sft.before_rl` asks for it, then train `train.steps` steps
    in the configured workflow. `on_step` sees every metrics row as it is logged. A resume refuses training data
    that changed since its checkpoint unless `accept_data_change` (then it continues at the checkpoint's data
    position in the new data)."""
    from asyncflow.workflow.run import complete_outputs

    with _settled(config, resume=resume, overwrite=overwrite) as (plan, stop):
        if plan.action == "finished":
            _settle_finished(plan, config)
            written = complete_outputs(config)
            log.info("the run in %s is already finished (checkpoint %s, train.steps=%d): %s", plan.path,
                     plan.checkpoint, config.train.steps,
                     f"wrote what was missing ({', '.join(written)})" if written else "nothing to do")
            return TrainResult(plan.path, plan.step, finished_before=True)
        run, sft = _start(config, plan, stop, on_step, accept_data_change)
        history = run.train()
    return TrainResult(run.run_dir, run.step, history, sft)


@contextmanager
def open_run(config: Config, *, resume: bool = False, overwrite: bool = False, on_step: StepCallback | None = None,
             accept_data_change: bool = False) -> Iterator[RLRun]:
    """`with open_run(config) as run:` the run `train` would train, built the way it builds it (the run folder
    claimed and settled, the input checked, the SFT warm-up when `sft.before_rl`), for a loop of one's own or a
    look at its pieces (`run.workflow`, `run.trainer`, `run.runtime`; `run.train()` trains it). The block holds
    the folder's lock; at its end the run is closed (replicas, ranks, engines) and the lock released. A finished
    run is opened at its last checkpoint (`run.train()` trains nothing). The first Ctrl-C within the block is
    recorded (`run.stop.requested`; `run.train()` stops after the step in progress), a second stops at once."""
    with _settled(config, resume=resume, overwrite=overwrite) as (plan, stop):
        run, _ = _start(config, plan, stop, on_step, accept_data_change)
        with closing(run):
            yield run


@contextmanager
def _settled(config: Config, *, resume: bool, overwrite: bool) -> Iterator[tuple[Plan, StopSignals]]:
    """The one way into a run folder: hold its lock and the stop signals for the block, and decide what happens
    in it (`RunFolder.plan`; a resume checked against the run's settings). Writes nothing yet."""
    from asyncflow.workflow.run_folder import RunFolder, check_resumable
    from asyncflow.workflow.stopping import StopSignals

    folder = RunFolder(config.run.output_dir)
    with folder.claim("train"), StopSignals() as stop:
        plan = folder.plan(steps=config.train.steps, resume=resume, overwrite=overwrite)
        if plan.action != "fresh":
            check_resumable(folder.path, _with_sft_model(config), plan.checkpoint)
        yield plan, stop


def _settle_finished(plan: Plan, config: Config) -> None:
    """A finished run's damaged files set aside, and its config.yaml written again when it is gone (the final
    export reads it)."""
    from asyncflow.workflow.run_folder import CONFIG_FILE, RunFolder

    folder = RunFolder(plan.path)
    folder.set_aside(plan)
    if not (plan.path / CONFIG_FILE).is_file():
        folder.write_config(_with_sft_model(config))


def _start(config: Config, plan: Plan, stop: StopSignals, on_step: StepCallback | None,
           accept_data_change: bool) -> tuple[RLRun, dict]:
    """Check the input (`preflight`, and a resume's data), carry `plan` out, run the SFT warm-up when asked and
    build the run; -> the run and the warm-up's summary ({} without one)."""
    from asyncflow.workflow.run import RLRun
    from asyncflow.workflow.run_folder import RunFolder
    from asyncflow.workflow.setup import preflight

    checked = preflight(config)
    if plan.checkpoint is not None:
        _check_same_data(plan.checkpoint, checked.train_set, accept_data_change)
    RunFolder(plan.path).prepare(plan)
    sft = {}
    if config.sft.before_rl:
        sft = _warm_up(config, stop, checked)
        config = _with_sft_model(config)
    return RLRun(config, plan, checked, stop=stop, on_step=on_step), sft


def _with_sft_model(config: Config) -> Config:
    """`config` training from its SFT warm-up model when `sft.before_rl`."""
    if not config.sft.before_rl:
        return config
    return config.model_copy(update={"model": config.model.model_copy(update={"path": str(sft_output(config))})})


def _warm_up(config: Config, stop, checked) -> dict:
    """`train`'s SFT warm-up: run unless a complete one is there; -> its `sft/steps`, `sft/val_accuracy`."""
    from asyncflow.workflow.sft import read_summary, run_sft

    out = sft_output(config)
    summary = read_summary(out)
    if summary is None:
        run_sft(config, out, stop=stop, checked=checked)
        summary = read_summary(out)
        if summary is None:
            raise RuntimeError(f"SFT ended without writing its summary to {out}")
    sft = {"sft/steps": summary.get("steps"), "sft/val_accuracy": summary.get("val_accuracy")}
    log.info("RL starts from the SFT model in %s (SFT steps %s, validation accuracy %s)",
             out, sft["sft/steps"], sft["sft/val_accuracy"])
    return sft


def _check_same_data(checkpoint: Path, train_set, accept_change: bool) -> None:
    """`ConfigError` when the training data differs from what `checkpoint` recorded, unless `accept_change`."""
    import json

    from asyncflow.data.prompts import data_change

    state = json.loads((checkpoint / "state.json").read_text())
    change = data_change(state.get("data_fingerprint"), train_set)
    if change is None:
        return
    position = state["data_position"]
    epoch, offset = divmod(position, len(train_set.examples))
    where = f"data position {position} (epoch {epoch}, example {offset} of {len(train_set.examples)} in seed order)"
    if not accept_change:
        raise ConfigError(
            f"--resume: the training data changed since {checkpoint.name} ({change}); the prompt order depends on "
            f"it, so prompts would be trained twice or skipped. Restore the data, or pass --accept-data-change to "
            f"continue on the new data from {where}"
        )
    log.warning("--accept-data-change: the training data changed since %s (%s); continuing on the new data from %s",
                checkpoint.name, change, where)


def sft(config: Config, output: str | Path | None = None) -> dict:
    """The SFT warm-up alone, as `asyncflow sft`; -> its summary (`steps`, `val_accuracy` ...) with `sft_model`."""
    from asyncflow.workflow.run_folder import RunFolder
    from asyncflow.workflow.sft import read_summary, run_sft
    from asyncflow.workflow.stopping import StopSignals

    out = Path(output) if output is not None else sft_output(config)
    with RunFolder(_owning_folder(out, Path(config.run.output_dir))).claim("sft"), StopSignals() as stop:
        run_sft(config, out, stop=stop)
    return {"sft_model": str(out), **(read_summary(out) or {})}


def _owning_folder(out: Path, run_dir: Path) -> Path:
    """The run folder whose lock covers writing `out`: `run_dir` when `out` is inside it, else `out` itself."""
    return run_dir if out.resolve().is_relative_to(run_dir.resolve()) else out


def evaluate(config: Config, checkpoint: str | Path) -> dict[str, float]:
    """Held-out accuracy of a checkpoint (`RUN_DIR/checkpoints/step_N`, on its run's base model), a run folder (its
    newest checkpoint), a Hugging Face model folder or `preset:NAME`, on `config`'s task, as `asyncflow eval`: an
    inference engine and the run's rewards only, no trainer."""
    from asyncflow.workflow.evaluation import evaluate_model
    from asyncflow.workflow.setup import preflight

    checked = preflight(config, training=False)
    return evaluate_model(config, str(checkpoint), checked.test_set)


def export(run_dir: str | Path, out: str | Path, *, step: int | None = None, merged: bool = False) -> Path:
    """A run's policy as a Hugging Face folder, as `asyncflow export` (`step`: default the newest intact
    checkpoint; `merged`: LoRA runs also write the merged model)."""
    from asyncflow.workflow.export import export_run
    from asyncflow.workflow.run_folder import RunFolder, claim_output

    run_dir, out = Path(run_dir), Path(out)
    if not out.resolve().is_relative_to(run_dir.resolve()) or not (run_dir / "config.yaml").is_file():
        with claim_output(out, "export"):  # one writer of OUT (the run is only read, its checkpoint pinned)
            return export_run(run_dir, out, step=step, merged=merged)  # (no config.yaml: "holds no run")
    with RunFolder(run_dir).claim("export"):  # writing into a run: not while another process writes it
        return export_run(run_dir, out, step=step, merged=merged)


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          name: str | None = None, engine: str = "torch", max_batch_size: int = 64, device: str = "cpu",
          dtype: str = "float32", seed: int = 0, chat_template: str | None = None, request_timeout_s: float = 600.0,
          limits=None, port_file: str | None = None, replicas: int = 1) -> None:
    """An OpenAI-compatible server over `model` (a Hugging Face folder, `preset:NAME`, a run folder or a checkpoint
    folder), as `asyncflow serve`; blocks until interrupted. Without `api_key` one is generated and printed; a
    host reachable from other machines needs one. `limits`: a `ServingLimits` (defaults otherwise). The port it
    listens on (`port=0`: a free one) is printed, and written to `port_file` when given, once it accepts
    connections. `replicas` > 1: that many engines behind a session-affine router (docs/serving.md)."""
    import secrets

    from asyncflow.workflow.serve import build_app, load_served

    try:
        from asyncflow.serving.limits import ServingLimits
        from asyncflow.serving.server import bind, serve_forever
    except ImportError as err:
        raise ValueError(f"asyncflow serve needs the serve extra (pip install 'asyncflow-rl[serve]'): {err}") from None
    limits = limits or ServingLimits()
    if not _is_loopback(host):
        if not api_key:
            raise ConfigError(f"--host {host} is reachable from other machines: give the key clients must send "
                              "(--api-key-file FILE or $ASYNCFLOW_API_KEY), or serve on 127.0.0.1")
        log.warning("serving on %s, reachable from other machines: anyone who can reach it and holds the key can "
                    "use the model", host)
    try:  # bound before the model loads, so a port in use fails at once in one line
        sock = bind(host, port)
    except OSError as err:
        raise ConfigError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    port = sock.getsockname()[1]
    key = api_key or secrets.token_urlsafe(24)
    try:
        weights = load_served(model, dtype=dtype, device=device)
        app, service = build_app(
            weights, api_key=key, name=name, engine=engine, max_batch_size=max_batch_size, device=device, seed=seed,
            chat_template=chat_template, request_timeout_s=request_timeout_s, limits=limits, replicas=replicas,
        )
    except BaseException:
        sock.close()
        raise

    def announce() -> None:
        if not api_key:
            print(f"API key (generated): {key}", flush=True)
        print(f"serving {name or weights.name!r} at http://{host}:{port}/v1", flush=True)
        if port_file:
            _write_atomically(Path(port_file), f"{port}\n")

    try:
        serve_forever(app, sock, limits=limits, on_listening=announce)
    finally:
        service.close()


def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def _write_atomically(path: Path, text: str) -> None:
    """`text` into `path` whole or not at all (a reader never sees half of it)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    partial.replace(path)
