"""An RL training run: set-up, the step loop, evaluation, checkpoints, and outputs.

Owns: building the pieces a workflow needs from the config (policy, inference engine, reward,
trainer, datasets), writing the run's outputs (config.yaml, metrics.jsonl, checkpoints/, plots,
TensorBoard, the final export) into a run folder claimed through `asyncflow.workflow.run_folder`,
resuming from the checkpoint its plan names, and the non-finite-loss policy.

The workflow (`sync`, `stream`, `async`) only decides how one step's rollouts are produced and
consumed; see `asyncflow.workflow.pipeline`.

Invariants:
- A step is one optimizer update and bumps the policy's weight version by one.
- Data position, RNG states, optimizer and weights are checkpointed together, with what the workflow
  had handed out ahead of training (`PipelineWorkflow.state_dict`); `--resume` trains every prompt
  exactly once, with the prompts and samples the uninterrupted run would have used (bit-exact where
  the workflow is deterministic; README, "Reliability").
- After `train.max_nan_steps` consecutive skipped (non-finite) steps the run stops with an error.
- Nothing is written before the run folder's plan is carried out (`RunFolder.prepare`): a run never
  writes into a folder holding another run, and a finished run resumed trains no step.
- Every training row of metrics.jsonl has `step`, `reward/mean`, `kl` (null when `algo.kl_coef` = 0:
  there is no reference model), `entropy`, `loss`, `time/step_s`, `throughput/samples_per_s` and
  `throughput/tokens_per_s`; evaluated steps (and step 0, before any update) add `eval/accuracy`.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from pathlib import Path

import torch

from asyncflow.config import Config
from asyncflow.engines.base import ShardedCheckpointing, make_inference_engine, make_train_engine
from asyncflow.models.loading import load_model, load_tokenizer, resolve_model_path
from asyncflow.observe import MetricsLogger, Timeline, TrainProgress, plot_metrics
from asyncflow.rewards import RewardHealth
from asyncflow.workers.loops import check_updates_in_flight
from asyncflow.workers.reward import RewardWorker
from asyncflow.workers.multiturn import make_rollout_worker
from asyncflow.workers.rollout import AGENT_PROMPT_COLUMN, Prompt
from asyncflow.workers.trainer import PolicyTrainer
from asyncflow.workflow.checkpoint import SHARDED_DIR, CheckpointError, load_checkpoint, save_checkpoint
from asyncflow.workflow.evaluation import evaluate
from asyncflow.workflow.export import EXPORT_DIR, export_run
from asyncflow.workflow.run_folder import Plan, RunFolder
from asyncflow.workflow.setup import (
    Preflight,
    build_reward_runner,
    datasets,
    multiturn_spec,
    prompt_encoder,
    sampling_params,
    seed_everything,
    train_engine_options,
)

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    pass


class RLRun:
    """One RL run in `run.output_dir`. `resume` / `overwrite`: what to do with a run already there (see
    `RunFolder.plan`), or `plan`: that decision, already taken and carried out by the caller. `checked`:
    the datasets `preflight` loaded. `outputs=False` (`asyncflow eval`) builds the pieces and writes nothing."""

    def __init__(
        self, config: Config, *, resume: bool = False, overwrite: bool = False, plan: Plan | None = None,
        checked: Preflight | None = None, outputs: bool = True,
    ):
        self.config = config
        self.run_dir = Path(config.run.output_dir)
        self.folder = RunFolder(self.run_dir)
        if outputs and plan is None:
            plan = self.folder.plan(steps=config.train.steps, resume=resume, overwrite=overwrite)
            self.folder.prepare(plan)
        seed_everything(config.run.seed)

        self.model_path = resolve_model_path(config.model.path, seed=config.run.seed)
        self.tokenizer = load_tokenizer(self.model_path)
        policy = self._load_policy()
        rollout_model = copy.deepcopy(policy).eval().requires_grad_(False)  # before LoRA adds adapters to `policy`
        self.train_engine = make_train_engine(
            config.train.engine, **train_engine_options(config, policy, self.model_path)
        )
        self.inference_engine = make_inference_engine(
            config.rollout.engine, model=rollout_model, max_batch_size=config.rollout.max_batch_size,
            device=config.model.device, seed=config.run.seed, **config.rollout.engine_options(),
        )
        if config.rollout.on_weight_update == "resume":
            check_updates_in_flight(self.inference_engine)
        self.params = sampling_params(config, self.tokenizer)
        self.eval_params = sampling_params(config, self.tokenizer, greedy=True)
        self.multiturn = multiturn_spec(config)
        self.rewards = RewardWorker(build_reward_runner(config), self.tokenizer)
        self.agent_options: dict | None = None  # with `agent.fn`: how replicas build their `AgentRolloutWorker`
        self.rollout = self._rollout_worker(policy)
        self.reward_health = RewardHealth(config.reward.max_error_fraction, config.reward.max_error_steps)
        self.trainer = PolicyTrainer(
            self.train_engine, config.algo, micro_batch_size=config.train.micro_batch_size,
            temperature=config.rollout.temperature, loss_mask=self.multiturn is not None,
        )
        if config.agent.fn is not None:  # agent rows carry their own prompt and a loss mask
            self.trainer.columns = self.trainer.columns + [c for c in ("loss_mask", AGENT_PROMPT_COLUMN)
                                                           if c not in self.trainer.columns]
        self.train_set, self.test_set = (checked.train_set, checked.test_set) if checked else datasets(config)
        self.encoder = prompt_encoder(config, self.tokenizer)

        self.step = 0
        self.version = 0
        self.data_position = 0
        self.next_group_id = 0
        self.nan_streak = 0
        self.samples_seen = 0
        self.workflow = None  # set by `train`; checkpoints ask it for its state
        self.resume_state: dict | None = None  # the workflow's part of the checkpoint resumed from
        self.start_wall = 0.0
        self.timeline = Timeline()
        self.eval_engine = None  # built on first evaluation
        self.eval_episodes = None  # its multi-turn worker, with `env.name`
        resuming = plan is not None and plan.checkpoint is not None
        if resuming:
            self._resume(plan.checkpoint)
        self.metrics = None
        if outputs:
            self.folder.write_config(config)
            self.metrics = MetricsLogger(
                self.run_dir, resume_from_step=self.step if resuming else None,
                tensorboard=config.observe.tensorboard, wandb=config.observe.wandb_run(config),
            )

    def _rollout_worker(self, policy: torch.nn.Module):
        """The built-in single-turn rollout, or with `agent.fn` the user's agent through the served engine."""
        cfg = self.config
        if cfg.agent.fn is None:
            return make_rollout_worker(self.inference_engine, self.params, cfg.rollout.group_size,
                                       multiturn=self.multiturn, tokenizer=self.tokenizer)
        from asyncflow.workers.agent import AgentRolloutWorker, absolute_agent_spec

        chat_template = Path(cfg.agent.chat_template).read_text() if cfg.agent.chat_template else None
        self.agent_options = dict(
            agent=absolute_agent_spec(cfg.agent.fn), model_name=cfg.run.name or "policy",
            max_model_len=int(getattr(policy.config, "max_position_embeddings", 0) or self.tokenizer.model_max_length),
            concurrency=cfg.agent.concurrency or cfg.rollout.max_batch_size,
            episode_timeout_s=cfg.agent.episode_timeout_s, chat_template=chat_template,
        )
        return AgentRolloutWorker(self.inference_engine, self.params, cfg.rollout.group_size, tokenizer=self.tokenizer,
                                  scorer=self.rewards, **self.agent_options)

    def _load_policy(self) -> torch.nn.Module:
        return load_model(self.model_path, dtype=self.config.model.dtype, device=self.config.model.device)

    # ---------------------------------------------------------------- data
    def data_cursor(self) -> dict:
        """Where the next prompt comes from: restoring it makes `next_prompts` repeat itself exactly."""
        return {
            "data_position": self.data_position, "next_group_id": self.next_group_id,
            "skipped_long_prompts": self.encoder.skipped,
        }  # fmt: skip

    def next_prompts(self, n: int) -> list[Prompt]:
        """The next `n` prompts in the seed-determined order, skipping (and counting) long ones."""
        prompts: list[Prompt] = []
        skipped_in_a_row = 0
        while len(prompts) < n:
            example = self.train_set.at(self.data_position)
            self.data_position += 1
            prompt = self.encoder.encode(example, self.next_group_id)
            if prompt is not None:
                if self.config.agent.fn is not None:
                    prompt.metadata["prompt"] = example.prompt  # the agent starts from the text
                prompts.append(prompt)
                self.next_group_id += 1
                skipped_in_a_row = 0
            else:
                skipped_in_a_row += 1
                if skipped_in_a_row >= len(self.train_set.examples):
                    raise ValueError(
                        "every training prompt is longer than data.max_prompt_tokens="
                        f"{self.config.data.max_prompt_tokens} "
                        f"tokens: nothing left to train on (raise data.max_prompt_tokens)"
                    )
        return prompts

    # ---------------------------------------------------------------- checkpoints
    def _state(self) -> dict:
        workflow = self.workflow.state_dict(self) if self.workflow is not None else {"cursor": self.data_cursor()}
        return {
            "version": self.version,
            **workflow.pop("cursor"),  # of the oldest partition not yet trained
            "workflow": workflow,
            "nan_streak": self.nan_streak,
            "samples_seen": self.samples_seen,
            "wall_s": self.wall_s(),
        }

    def save(self) -> Path:
        generator = getattr(self.inference_engine, "generator", None)
        engine = self.train_engine
        return save_checkpoint(
            self.run_dir,
            self.step,
            engine.state_dict(),
            engine.training_state(),
            self._state(),
            generator.get_state() if generator is not None else None,
            keep=self.config.checkpoint.keep,
            write_sharded=engine.save_sharded if isinstance(engine, ShardedCheckpointing) else None,
        )

    def _resume(self, checkpoint: Path) -> None:
        weights, training_state, state, rng = load_checkpoint(checkpoint)
        sharded = checkpoint / SHARDED_DIR
        if isinstance(self.train_engine, ShardedCheckpointing) and sharded.is_dir():
            self.train_engine.load_sharded(sharded)  # weights and optimizer state, resharded to this world size
            self.train_engine.load_training_state(training_state)
        elif sharded.is_dir():
            raise CheckpointError(f"{checkpoint}: written by a multi-rank engine (its optimizer state is sharded in "
                                  f"{SHARDED_DIR}/): resume it with train.engine=fsdp2 (any train.world_size)")
        else:
            self.train_engine.load_checkpoint(weights, training_state)
        self.step = state["step"]
        self.version = state["version"]
        self.data_position = state["data_position"]
        self.next_group_id = state["next_group_id"]
        self.encoder.skipped = state.get("skipped_long_prompts", 0)
        self.resume_state = state.get("workflow")
        self.nan_streak = state["nan_streak"]
        self.samples_seen = state["samples_seen"]
        self.wall_offset = state["wall_s"]
        self.inference_engine.update_weights(self.train_engine.state_dict(), self.version)
        generator = getattr(self.inference_engine, "generator", None)
        if generator is not None and rng.get("generator") is not None:
            generator.set_state(rng["generator"])
        log.info("resumed from %s (step %d)", checkpoint, self.step)

    wall_offset = 0.0

    def wall_s(self) -> float:
        return self.wall_offset + (time.perf_counter() - self.start_wall if self.start_wall else 0.0)

    # ---------------------------------------------------------------- loop
    def evaluate(self) -> dict[str, float]:
        """Greedy held-out accuracy of the current policy, on an engine of its own (the rollout engine
        may be busy on another thread or process)."""
        if not self.test_set:
            return {}
        if self.eval_engine is None:
            self.eval_engine = make_inference_engine(
                self.config.rollout.engine,
                model=self._load_policy().eval().requires_grad_(False),
                max_batch_size=self.config.rollout.max_batch_size,
                device=self.config.model.device,
                seed=self.config.run.seed,
                **self.config.rollout.engine_options(),
            )
            if self.multiturn is not None:
                self.eval_episodes = make_rollout_worker(self.eval_engine, self.eval_params, 1,
                                                         multiturn=self.multiturn, tokenizer=self.tokenizer)
        self.eval_engine.update_weights(self.train_engine.state_dict(), self.version)
        t0 = time.time()
        result = evaluate(self.eval_engine, self.rewards, self.encoder, self.test_set, self.eval_params,
                          episodes=self.eval_episodes)
        self.timeline.add_span("trainer", "evaluate", t0, time.time(), step=self.step)
        return result

    def train(self, workflow) -> list[dict]:
        """Run `workflow.step(self)` until `train.steps`; returns the logged metrics rows. The training engine is
        closed at the end (a multi-rank engine stops its ranks), also when a step fails."""
        try:
            return self._train(workflow)
        finally:
            close = getattr(self.train_engine, "close", None)
            if close is not None:
                close()

    def _train(self, workflow) -> list[dict]:
        cfg = self.config
        history = []
        self.workflow = workflow
        if self.step >= cfg.train.steps:
            log.info("the run in %s is finished (step %d, train.steps=%d): nothing to train", self.run_dir,
                     self.step, cfg.train.steps)
            workflow.close()
            self.metrics.close()
            return history
        self.start_wall = time.perf_counter()
        if self.step == 0:
            history.append(self._log({"samples": 0, **self.evaluate()}))
        show = {"reward": "reward/mean", "acc": "eval/accuracy", "loss": "loss", "entropy": "entropy"}
        if cfg.algo.kl_coef > 0:  # `kl` is measured only against a reference model
            show["kl"] = "kl"
        show["mismatch"] = "mismatch/abs_log_ratio"
        if cfg.algo.mismatch_correction != "off":
            show["corrected"] = {"token_tis": "mismatch/truncated_tokens_fraction",
                                 "geo_mis": "mismatch/masked_sequences_fraction"}[cfg.algo.mismatch_correction]
        if cfg.workflow.mode == "async":
            show["stale"] = "staleness/mean"
            if cfg.rollout.on_weight_update == "resume":
                show["spanning"] = "staleness/rows_spanning_versions"
        bar = TrainProgress(
            cfg.train.steps,
            initial=self.step,
            description=f"{cfg.workflow.mode} RL",
            enabled=cfg.run.progress,
            show=show,
        )
        with bar:
            while self.step < cfg.train.steps:
                t0 = time.perf_counter()
                metrics = workflow.step(self)
                self.step += 1
                metrics["time/step_s"] = time.perf_counter() - t0
                metrics.update(self._throughput(metrics))
                self._check_finite(metrics)
                last = self.step == cfg.train.steps
                if last or (cfg.eval.every and self.step % cfg.eval.every == 0):
                    metrics.update(self.evaluate())
                history.append(self._log(metrics))
                self.reward_health.observe_totals(  # Ray: the replicas' totals are in `metrics`; inline: the worker's
                    self.step, samples=int(metrics.get("rollout/samples", 0)),
                    errors_total=metrics.get("reward/errors", self.rewards.errors),
                    timeouts_total=metrics.get("reward/timeouts", self.rewards.timeouts),
                    detail=self.rewards.last_failure,
                )
                bar.update(self.step, metrics)
                if last or (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0):
                    self.save()
        workflow.close()
        self.close_rollout()
        self.metrics.close()
        self.write_reports()
        if cfg.export.at_end:
            export_run(self.run_dir, self.run_dir / EXPORT_DIR, merged=cfg.export.merged, replace=True)
        return history

    def close_rollout(self) -> None:
        """Stop what the rollout worker runs besides the engine (an agent rollout's HTTP server)."""
        close = getattr(self.rollout, "close", None)
        if close is not None:
            close()

    def write_reports(self) -> None:
        """Plots of reward and accuracy, the Chrome trace, Gantt and utilization charts, each role's idle fraction."""
        plot_metrics(self.run_dir, keys=("reward/mean", "eval/accuracy"), out_png=self.run_dir / "curves.png")
        if self.timeline.events:
            self.timeline.to_chrome_trace(self.run_dir / "timeline.json")
            self.timeline.gantt_png(self.run_dir / "timeline.png", title=f"{self.config.workflow.mode} workers")
            self.timeline.utilization_png(self.run_dir / "utilization.png", f"{self.config.workflow.mode} workers")
            idle = self.timeline.idle_fractions()
            log.info("idle fraction per worker: %s", {k: round(v, 3) for k, v in idle.items()})

    def _throughput(self, metrics: dict) -> dict[str, float]:
        self.samples_seen += int(metrics.get("rollout/samples", 0))
        step_s = metrics["time/step_s"]
        return {
            "samples": float(self.samples_seen),
            "throughput/samples_per_s": metrics.get("rollout/samples", 0) / step_s,
            "throughput/tokens_per_s": metrics.get("rollout/tokens", 0) / step_s,
        }

    def _check_finite(self, metrics: dict) -> None:
        if metrics.get("train/skipped_step", 0.0) > 0:
            self.nan_streak += 1
            log.warning(
                "step %d: non-finite loss or gradient, update skipped (%d in a row)", self.step, self.nan_streak
            )
            if self.nan_streak >= self.config.train.max_nan_steps:
                raise NonFiniteLossError(
                    f"{self.nan_streak} consecutive steps had a non-finite loss (train.max_nan_steps="
                    f"{self.config.train.max_nan_steps}); last metrics: {metrics}"
                )
        else:
            self.nan_streak = 0

    def _log(self, metrics: dict) -> dict:
        if "loss" in metrics:  # a training step: `kl` is always logged, null in metrics.jsonl without a reference
            metrics.setdefault("kl", math.nan)
        metrics = {
            "wall_s": self.wall_s(),
            "weight_version": float(self.version),
            "data/skipped_long_prompts": float(self.encoder.skipped),
            "reward/errors": float(self.rewards.errors),
            "reward/timeouts": float(self.rewards.timeouts),
            **metrics,
        }
        self.metrics.log(self.step, metrics)
        return {"step": self.step, **metrics}
