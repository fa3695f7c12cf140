"""An RL training run: set-up, the step loop (the one owner of run state), evaluation, checkpoints, outputs.

Owns: building the trainer side from the config (policy, training engine, trainer, rewards, prompt source)
and the runtime that places the rollout replicas, wiring them into the workflow as explicit collaborators,
the `RunState` the step loop changes, writing the run's outputs (config.yaml, metrics.jsonl, checkpoints/,
plots, TensorBoard, the final export) into a run folder claimed through `asyncflow.workflow.run_folder`,
resuming from the checkpoint its plan names, and the non-finite-loss policy.

The workflow (`sync`, `stream`, `async`) only decides how one step's rollouts are produced and
consumed; see `asyncflow.workflow.pipeline`.

Invariants:
- Only the step loop changes `RunState`: a workflow gets the step and version and returns the version it
  published; no object below the loop is handed the run.
- A step is one optimizer update and bumps the policy's weight version by one.
- Pieces are built where the runtime places them: the driver holds the policy being trained only when it trains
  it itself (the built-in engine; with FSDP2 it loads no copy: the ranks load and hold it, and stream each weight
  version to the publisher one bucket at a time) and builds no inference engine of its own: `sync` evaluates on
  its idle rollout engine, the other modes generate with the trainer's policy module (no weight copy); only a
  trainer whose weights live on other ranks (FSDP2) gets an evaluation engine, built at the first evaluation.
- Data position, RNG states, optimizer and weights are checkpointed together, with what the workflow
  had handed out ahead of training (`PipelineWorkflow.checkpoint_state`); `--resume` trains every prompt
  exactly once, with the prompts and samples the uninterrupted run would have used (bit-exact where
  the workflow is deterministic; docs/reliability.md).
- After `train.max_nan_steps` consecutive skipped (non-finite) steps the run stops with an error.
- SIGINT / SIGTERM stop the loop after the step in progress with a checkpoint and the outputs
  (`asyncflow.workflow.stopping`); a finished run resumed writes the outputs a crash left unwritten
  (`complete_outputs`). The timeline is written with every checkpoint and continued on resume.
- One way in: an `RLRun` is built only by `asyncflow.api` (`open_run`, `train`), from the plan it carried out
  (`RunFolder.prepare`, the folder's lock held) and `preflight`'s result; its constructor takes no other mode.
  So nothing is written before the plan is carried out, a run never writes into a folder holding another run,
  and a finished run resumed trains no step.
- Every training row of metrics.jsonl has `step`, `reward/mean`, `kl` (null when `algo.kl_coef` = 0:
  there is no reference model), `entropy`, `loss`, `time/step_s`, `throughput/samples_per_s` and
  `throughput/tokens_per_s`; evaluated steps (and step 0, before any update) add `eval/accuracy`.
  Counters are per step (`reward/errors`, `reward/timeouts`) or named as totals over the run, resumes
  included (`reward/errors_total`, `reward/timeouts_total`, `data/skipped_long_prompts_total`). Each training row
  has the peak resident memory of every process that reports one (`memory/peak_rss_mb/driver`, `.../rank_R`
  of FSDP2 ranks, `.../rollout_R` of Ray replicas; `asyncflow.observe.memory`).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from asyncflow.algos.correction import CORRECTION_COUNTS
from asyncflow.config import Config
from asyncflow.engines.base import ShardedCheckpointing, make_train_engine
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.models.loading import load_tokenizer, resolve_model_path
from asyncflow.observe import MetricsLogger, Timeline, TrainProgress, plot_metrics
from asyncflow.observe.live import LiveMetrics, Watchdog
from asyncflow.observe.memory import memory_metrics, return_freed_blocks
from asyncflow.rewards import RewardHealth
from asyncflow.rewards.health import counter_growth
from asyncflow.runtime.base import Runtime, build_generating_worker
from asyncflow.runtime.factory import make_runtime
from asyncflow.weights.buckets import Weights
from asyncflow.weights.segments import sweep_dead_segments
from asyncflow.workers.loops import check_updates_in_flight
from asyncflow.workers.multiturn import make_rollout_worker
from asyncflow.workers.reward import RewardWorker
from asyncflow.workers.rollout import GeneratingRole
from asyncflow.workers.trainer import PolicyTrainer
from asyncflow.workflow import watch
from asyncflow.workflow.checkpoint import (
    SHARDED_DIR,
    CheckpointError,
    checkpoint_weights,
    load_checkpoint,
    save_checkpoint,
)
from asyncflow.workflow.evaluation import evaluate, evaluation_spec
from asyncflow.workflow.export import EXPORT_DIR, export_run
from asyncflow.workflow.pipeline import PipelineWorkflow
from asyncflow.workflow.run_folder import TIMELINE_FILE, Plan, RunFolder, fixed_settings
from asyncflow.workflow.setup import (
    Preflight,
    rl_engine_options,
    row_columns,
    run_inputs,
    seed_everything,
)
from asyncflow.workflow.stopping import StopSignals

log = logging.getLogger(__name__)

CURVES_FILE = "curves.png"
METRICS_PORT_FILE = "metrics_port"  # the port `/metrics` listens on (`observe.metrics_port`)


class RunStalled(RuntimeError):
    """The watchdog found no progress for `observe.stall_s` with `stall_action: stop`; the message names the stage."""


class NonFiniteLossError(RuntimeError):
    pass


@dataclass
class RunState:
    """What the step loop owns: the step trained next, the policy's weight version, and the counters that
    checkpoints carry. Nothing else changes it."""

    step: int = 0
    version: int = 0
    nan_streak: int = 0
    samples_seen: int = 0
    wall_offset: float = 0.0
    reward_errors: int = 0  # totals over the run, resumes included
    reward_timeouts: int = 0


class RLRun:
    """One RL run in `run.output_dir`, built by `asyncflow.open_run` / `asyncflow.train` only: `plan` is what they
    decided for the run folder and carried out (`RunFolder.prepare`, the folder's lock held), `checked` the
    datasets `preflight` loaded, `stop` the command's signal handlers. `on_step` is called with each metrics row
    as it is logged."""

    def __init__(self, config: Config, plan: Plan, checked: Preflight, *, stop: StopSignals,
                 on_step: Callable[[dict], None] | None = None):
        self.config = config
        self.on_step = on_step
        self.stop = stop
        self.run_dir = Path(config.run.output_dir)
        self.folder = RunFolder(self.run_dir)
        seed_everything(config.run.seed)

        model_path = resolve_model_path(config.model.path, seed=config.run.seed)
        self.tokenizer = load_tokenizer(model_path)
        # built below; `close` stops what was built when the constructor fails part way
        self._runtime: Runtime | None = None
        self._workflow: PipelineWorkflow | None = None
        self.eval_worker: GeneratingRole | None = None  # what evaluation generates with: see `evaluate`
        self.live: LiveMetrics | None = None
        self.watchdog: Watchdog | None = None
        self.closed = False
        timeline_file = self.run_dir / TIMELINE_FILE
        resuming = plan.checkpoint is not None and timeline_file.is_file()
        self.timeline = Timeline.from_chrome_trace(timeline_file) if resuming else Timeline()
        self.state = RunState()
        self.start_wall = 0.0
        self._scorer_totals = (0, 0)  # the scorers' own counters when last logged (see `_count_reward_failures`)
        try:
            inputs = run_inputs(config, model_path, self.tokenizer, checked)
            self.rewards = RewardWorker(inputs.rewards, self.tokenizer)
            self.reward_health = RewardHealth(config.reward.max_error_fraction, config.reward.max_error_steps)
            self.spec = inputs.spec
            if config.train.engine == "fsdp2" and config.runtime.kind == "ray":
                # This process runs no model, it passes weight buckets on (to a checkpoint, a publisher): freed
                # buffers of a MiB or more leave its resident size (glibc kept ~150 MB of them at 166M parameters)
                return_freed_blocks()
            sweep_dead_segments()  # shared-memory segments that killed runs left behind (`asyncflow.weights.segments`)
            # before the trainer: Ray replicas start (imports, model load, engine start) while its ranks load
            self._runtime = make_runtime(config, self.spec, self.rewards)
            self.train_engine = make_train_engine(config.train.engine, **rl_engine_options(config, model_path,
                                                                                           self.tokenizer))
            self.trainer = PolicyTrainer(
                self.train_engine, config.algo, micro_batch_size=config.train.micro_batch_size,
                temperature=config.rollout.temperature, row_columns=row_columns(self.spec),
                reward_columns=config.reward.columns,
                max_tokens_per_micro_batch=config.train.max_tokens_per_micro_batch,
            )
            self.test_set = checked.test_set
            self.prompts, self.eval_encoder, self.eval_params = inputs.prompts, inputs.eval_encoder, inputs.eval_params
            if config.rollout.on_weight_update == "resume" and self.runtime.local_rollout is not None:
                check_updates_in_flight(self.runtime.local_rollout.engine)
            self.resume_state = self._resume(plan.checkpoint) if plan.checkpoint is not None else None
            policy_weights = self.train_engine.state_dict
            weights_to_publish: Callable[[], Weights] = functools.partial(
                self.train_engine.weight_stream, distinct=True, dtype=getattr(torch, config.rollout_dtype()))
            if self.spec.adapter is not None:  # LoRA adapter sync: a version is the adapter alone
                policy_weights = weights_to_publish = cast(TorchTrainEngine, self.train_engine).adapter_weights
            self._workflow = PipelineWorkflow(
                config, runtime=self.runtime, trainer=self.trainer, prompts=self.prompts,
                policy_weights=policy_weights, rewards=self.rewards, timeline=self.timeline,
                scores_rows=self.spec.scores_rows, stages=inputs.stages,
                weights_to_publish=weights_to_publish,
            )
        except BaseException:
            self.close()
            raise
        self.folder.write_config(config)
        self.metrics = MetricsLogger(
            self.run_dir, resume_from_step=self.state.step if self.resume_state is not None else None,
            tensorboard=config.observe.tensorboard, wandb=config.observe.wandb_run(config),
        )

    @property
    def runtime(self) -> Runtime:
        """Where the rollout replicas run."""
        if self._runtime is None:
            raise RuntimeError("the run's runtime is not built: its constructor failed")
        return self._runtime

    @property
    def workflow(self) -> PipelineWorkflow:
        if self._workflow is None:
            raise RuntimeError("the run's workflow is not built: its constructor failed")
        return self._workflow

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def version(self) -> int:
        return self.state.version

    # ---------------------------------------------------------------- checkpoints
    def save(self) -> Path:
        started = time.time()
        workflow = self.workflow.checkpoint_state(self.state.step)
        state = {
            "version": self.state.version,
            **workflow.pop("cursor"),  # of the oldest partition not yet trained
            "workflow": workflow,
            "nan_streak": self.state.nan_streak,
            "samples_seen": self.state.samples_seen,
            "reward_errors": self.state.reward_errors,
            "reward_timeouts": self.state.reward_timeouts,
            "wall_s": self.wall_s(),
            "fixed_settings": fixed_settings(self.config),  # what a resume may not change, if config.yaml is lost
        }
        engine = self.train_engine
        path = save_checkpoint(
            self.run_dir, self.state.step, checkpoint_weights(engine), engine.training_state(), state,
            keep=self.config.checkpoint.keep,
            write_sharded=engine.save_sharded if isinstance(engine, ShardedCheckpointing) else None,
        )
        self.timeline.add_span("trainer", "checkpoint", started, time.time(), step=self.state.step)
        self.timeline.to_chrome_trace(self.run_dir / TIMELINE_FILE)
        return path

    def _resume(self, checkpoint: Path) -> dict:
        """Restore weights, optimizer, RNGs, the prompt cursor and `RunState`; returns the workflow's part."""
        sharded = checkpoint / SHARDED_DIR
        engine = self.train_engine
        shards = engine if isinstance(engine, ShardedCheckpointing) and sharded.is_dir() else None
        # the ranks read their shards: the driver reads no copy of the full weights
        weights, training_state, state, _ = load_checkpoint(checkpoint, with_weights=shards is None)
        if shards is not None:
            shards.load_sharded(sharded)  # weights and optimizer state, resharded to this world size
            self.train_engine.load_training_state(training_state)
        elif sharded.is_dir():
            raise CheckpointError(f"{checkpoint}: written by a multi-rank engine (its optimizer state is sharded in "
                                  f"{SHARDED_DIR}/): resume it with train.engine=fsdp2 (any train.world_size)")
        else:
            self.train_engine.load_checkpoint(weights, training_state)
        self.prompts.restore(state)
        self.state = RunState(step=state["step"], version=state["version"], nan_streak=state["nan_streak"],
                              samples_seen=state["samples_seen"], wall_offset=state["wall_s"],
                              reward_errors=state.get("reward_errors", 0),
                              reward_timeouts=state.get("reward_timeouts", 0))
        log.info("resumed from %s (step %d)", checkpoint, self.state.step)
        return state.get("workflow") or {}

    def wall_s(self) -> float:
        return self.state.wall_offset + (time.perf_counter() - self.start_wall if self.start_wall else 0.0)

    # ---------------------------------------------------------------- evaluation
    def evaluate(self) -> dict[str, float]:
        """Greedy held-out accuracy of the current policy: on the `sync` rollout worker (idle between steps, its
        weights current); otherwise with the trainer's own policy module (no copy of the weights), or, when the
        weights live on ranks elsewhere (FSDP2), on an engine of its own loaded with them."""
        if not self.test_set:
            return {}
        local = self.runtime.local_rollout
        borrowed = None
        if self.config.workflow.mode == "sync" and local is not None:
            engine, episodes = local.engine, None
            if self.spec.multiturn is not None:
                episodes = self.eval_worker = self.eval_worker or make_rollout_worker(
                    engine, self.eval_params, 1, multiturn=self.spec.multiturn, tokenizer=self.tokenizer)
        else:
            borrowed = self.train_engine.policy_module()
            if self.eval_worker is None:
                self.eval_worker = build_generating_worker(
                    evaluation_spec(self.spec, self.eval_params), policy=borrowed)
            engine = self.eval_worker.engine
            if borrowed is None:
                engine.update_weights(self.train_engine.state_dict(), self.state.version)
            else:
                borrowed.eval()  # the trainer's module: back to training mode below
            episodes = self.eval_worker if self.spec.multiturn is not None else None
        t0 = time.time()
        try:
            result = evaluate(engine, self.rewards, self.eval_encoder, self.test_set, self.eval_params,
                              episodes=episodes)
        finally:
            if borrowed is not None:
                borrowed.train()
        self.timeline.add_span("trainer", "evaluate", t0, time.time(), step=self.state.step)
        return result

    # ---------------------------------------------------------------- the step loop
    def train(self) -> list[dict]:
        """Run the workflow's steps until `train.steps`; returns the logged metrics rows. Everything the run
        started (replicas, ranks, engines) is stopped at the end, also when a step fails. On SIGINT / SIGTERM:
        `RunStopped` after a checkpoint of the last finished step."""
        try:
            self.stop.install()  # again: a Ray runtime's `ray.init` replaced them
            return self._train()
        finally:
            self.close()

    def _train(self) -> list[dict]:
        cfg = self.config
        state = self.state
        history: list[dict] = []
        if state.step >= cfg.train.steps:
            log.info("the run in %s is finished (step %d, train.steps=%d): nothing to train", self.run_dir,
                     state.step, cfg.train.steps)
            self.metrics.close()
            return history
        self.start_wall = time.perf_counter()
        self.workflow.start(state.step, state.version, self.resume_state)
        self._watch()
        if state.step == 0:
            history.append(self._log({"samples": 0, **self.evaluate()}))
        with TrainProgress(cfg.train.steps, initial=state.step, description=f"{cfg.workflow.mode} RL",
                           enabled=cfg.run.progress, show=self._progress_keys()) as bar:
            while state.step < cfg.train.steps:
                t0 = time.perf_counter()
                result = self.workflow.step(state.step, state.version)
                if result.version != state.version + 1:
                    raise RuntimeError(f"step {state.step}: the workflow published version {result.version}, "
                                       f"not {state.version + 1}")
                state.step += 1
                state.version = result.version
                metrics = result.metrics
                metrics["time/step_s"] = time.perf_counter() - t0
                metrics.update(self.train_engine.metrics())  # e.g. its ranks' peak memory
                metrics.update(self.runtime.memory_metrics())  # its rollout replicas' peak memory
                metrics.update(memory_metrics("driver"))
                metrics.update(self._throughput(metrics))
                self._check_finite(metrics)
                last = state.step == cfg.train.steps
                if last or (cfg.eval.every and state.step % cfg.eval.every == 0):
                    metrics.update(self.evaluate())
                row = self._log(metrics)
                history.append(row)
                self.reward_health.check(state.step, samples=int(row.get("rollout/samples", 0)),
                                         errors=int(row["reward/errors"]), timeouts=int(row["reward/timeouts"]),
                                         detail=self.rewards.last_failure)
                bar.update(state.step, row)
                if last or self.stop.requested or (cfg.checkpoint.every and state.step % cfg.checkpoint.every == 0):
                    checkpoint = self.save()
                if self.stop.requested and not last:
                    self.metrics.close()
                    write_reports(self.run_dir, self.timeline, cfg.workflow.mode)
                    raise self.stop.stopped(f"after step {state.step}: checkpoint {checkpoint} written; continue with "
                                            "--resume")
        self.workflow.finish()
        self.train_engine.close()  # the last checkpoint holds its state: freed before the reports' plots
        self.metrics.close()
        write_reports(self.run_dir, self.timeline, cfg.workflow.mode)
        if cfg.export.at_end:
            export_run(self.run_dir, self.run_dir / EXPORT_DIR, merged=cfg.export.merged, replace=True)
        return history

    def close(self) -> None:
        """Stop the weight channel, the evaluation engine, the training engine (a multi-rank engine's ranks) and
        then the runtime (replicas, their engines and servers): last, as its close may end the Ray session the
        others' handles belong to (`hold_ray`); then the reward worker's threads. Idempotent."""
        if self.closed:
            return
        self.closed = True
        train_engine = getattr(self, "train_engine", None)  # absent when the constructor failed before building it
        for part in (self.watchdog, self.live, self._workflow, self.eval_worker, train_engine, self._runtime):
            if part is not None:
                part.close()
        rewards = getattr(self, "rewards", None)  # absent when the constructor failed before building it
        if rewards is not None:
            rewards.close()  # after the runtime: an inline runtime's reward thread scores with it

    def _watch(self) -> None:
        """Start `/metrics` (`observe.metrics_port`) and the watchdog (`observe.stall_s`)."""
        observe, workflow = self.config.observe, self.workflow
        if observe.metrics_port is not None:
            def run_series() -> dict:
                return {"step": {(): self.state.step}, "weight_version": {(): self.state.version},
                        **watch.live_series(workflow, self.state.step)}

            self.live = LiveMetrics(observe.metrics_port, {"run": run_series}, host=observe.metrics_host)
            (self.run_dir / METRICS_PORT_FILE).write_text(f"{self.live.port}\n")
        if observe.stall_s is not None:
            def stalled(message: str) -> None:
                self.stop.fail(RunStalled(f"step {self.state.step}: {message}"))

            self.watchdog = Watchdog(observe.stall_s, progress=lambda: watch.progress(workflow, self.state.step),
                                     explain=lambda: watch.explain_waits(workflow, self.state.step),
                                     on_stall=stalled if observe.stall_action == "stop" else None)

    def _progress_keys(self) -> dict[str, str]:
        cfg = self.config
        show = {"reward": "reward/mean", "acc": "eval/accuracy", "loss": "loss", "entropy": "entropy"}
        if cfg.algo.kl_coef > 0:  # `kl` is measured only against a reference model
            show["kl"] = "kl"
        show["mismatch"] = "mismatch/abs_log_ratio"
        corrections = cfg.algo.mismatch_corrections()
        if corrections:  # what the one correction changed; of a combination, the tokens it masked
            show["corrected"] = (f"mismatch/{CORRECTION_COUNTS[corrections[0]]}_fraction" if len(corrections) == 1
                                 else "mismatch/masked_tokens_fraction")
        if cfg.workflow.mode == "async":
            show["stale"] = "staleness/mean"
            if cfg.rollout.on_weight_update == "resume":
                show["spanning"] = "staleness/rows_spanning_versions"
        return show

    def _throughput(self, metrics: dict) -> dict[str, float]:
        self.state.samples_seen += int(metrics.get("rollout/samples", 0))
        step_s = metrics["time/step_s"]
        return {
            "samples": float(self.state.samples_seen),
            "throughput/samples_per_s": metrics.get("rollout/samples", 0) / step_s,
            "throughput/tokens_per_s": metrics.get("rollout/tokens", 0) / step_s,
        }

    def _check_finite(self, metrics: dict) -> None:
        if metrics.get("train/skipped_step", 0.0) > 0:
            self.state.nan_streak += 1
            log.warning("step %d: non-finite loss or gradient, update skipped (%d in a row)", self.state.step,
                        self.state.nan_streak)
            if self.state.nan_streak >= self.config.train.max_nan_steps:
                raise NonFiniteLossError(
                    f"{self.state.nan_streak} consecutive steps had a non-finite loss (train.max_nan_steps="
                    f"{self.config.train.max_nan_steps}); last metrics: {metrics}"
                )
        else:
            self.state.nan_streak = 0

    def _count_reward_failures(self, metrics: dict) -> dict[str, float]:
        """This step's reward errors and timeouts, and the run's totals. The scorers count from their start (Ray:
        the replicas' totals are in `metrics`; inline: the worker's), so a step's count is a counter's growth."""
        errors_now = int(metrics.get("reward/errors", self.rewards.errors))
        timeouts_now = int(metrics.get("reward/timeouts", self.rewards.timeouts))
        errors = counter_growth(errors_now, self._scorer_totals[0])
        timeouts = counter_growth(timeouts_now, self._scorer_totals[1])
        self._scorer_totals = (errors_now, timeouts_now)
        self.state.reward_errors += errors
        self.state.reward_timeouts += timeouts
        return {"reward/errors": float(errors), "reward/timeouts": float(timeouts),
                "reward/errors_total": float(self.state.reward_errors),
                "reward/timeouts_total": float(self.state.reward_timeouts)}

    def _log(self, metrics: dict) -> dict:
        if "loss" in metrics:  # a training step: `kl` is always logged, null in metrics.jsonl without a reference
            metrics.setdefault("kl", math.nan)
        metrics = {
            "wall_s": self.wall_s(),
            "weight_version": float(self.state.version),
            "data/skipped_long_prompts_total": float(self.prompts.encoder.skipped),
            **metrics,
            **self._count_reward_failures(metrics),
        }
        self.metrics.log(self.state.step, metrics)
        row = {"step": self.state.step, **metrics}
        if self.live is not None:
            self.live.record(row)
        if self.on_step is not None:
            self.on_step(row)
        return row


def write_reports(run_dir: Path, timeline: Timeline, mode: str) -> None:
    """Plots of reward and accuracy, the Chrome trace, Gantt and utilization charts, each role's idle fraction."""
    plot_metrics(run_dir, keys=("reward/mean", "eval/accuracy"), out_png=run_dir / CURVES_FILE)
    if timeline.events:
        timeline.to_chrome_trace(run_dir / TIMELINE_FILE)
        timeline.gantt_png(run_dir / "timeline.png", title=f"{mode} workers")
        timeline.utilization_png(run_dir / "utilization.png", f"{mode} workers")
        idle = timeline.idle_fractions()
        log.info("idle fraction per worker: %s", {k: round(v, 3) for k, v in idle.items()})


def complete_outputs(config: Config) -> list[str]:
    """For a finished run (its last checkpoint written): write the outputs a crash after that checkpoint left
    unwritten (plots, timeline charts, the final export); -> the names written."""
    run_dir = Path(config.run.output_dir)
    written = []
    if not (run_dir / CURVES_FILE).is_file() or not (run_dir / "timeline.png").is_file():
        trace = run_dir / TIMELINE_FILE
        write_reports(run_dir, Timeline.from_chrome_trace(trace) if trace.is_file() else Timeline(),
                      config.workflow.mode)
        written.append("plots")
    if config.export.at_end and not (run_dir / EXPORT_DIR).is_dir():
        export_run(run_dir, run_dir / EXPORT_DIR, merged=config.export.merged, replace=True)
        written.append(EXPORT_DIR)
    return written
