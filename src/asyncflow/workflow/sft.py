"""Supervised warm-up: train on (prompt, answer) pairs so a tiny random model starts RL with a non-zero reward.

Owns: the SFT loop, its stopping rule, and its output folder: an ordinary Hugging Face model that `model.path` can
point at (merged weights under LoRA), `sft_summary.json`, `metrics.jsonl` (`sft/*`) and `checkpoints/step_N/`. It
trains on the `TrainEngine` of `train.engine` / `world_size` / `lora` in micro-batches of `train.micro_batch_size`,
with SFT's own optimizer settings (`sft.lr`, `betas`, ...); the loss is `sft_loss` on the answer tokens only. With
`env.name`, SFT trains on the environment's tool-use demonstrations (only the model's turns in the loss).

Stopping rule: with `sft.stop_accuracy` set, every `sft.check_every` steps (and at `sft.steps`) the model's greedy
accuracy on the validation split is measured exactly as the RL run measures its held-out accuracy (same inference
engine, sampling parameters and rewards; solved = reward >= 1; episodes with `env.name`), and SFT stops at the
first check that reaches the target; `sft.steps` bounds the run (ending there below the target logs a warning).

Invariants:
- The output folder is complete or absent: SFT writes into `.tmp_NAME` beside it and renames that into place
  after `sft_summary.json`, so a folder with a summary is a finished SFT (`read_summary`).
- SFT resumes like RL: its checkpoints (`checkpoint.every`, and on SIGINT / SIGTERM) hold weights, optimizer,
  schedule, the global RNGs, the example sampler's state and the validation checks, and SFT run again (`asyncflow
  sft`, or `train` with `sft.before_rl`) continues from the newest intact one in `.tmp_NAME`: the same examples in
  the same order, the same final model bit for bit. It starts again only when there is none, or SFT's settings or
  data changed since (`sft_settings`, said in a warning). Its writer holds the run folder's lock (`asyncflow.api`).
  SIGINT / SIGTERM stop SFT between steps (`RunStopped`) after that checkpoint, without writing the model.
- The prompt is rendered exactly as the RL rollout renders it (`render_prompt`) and the answer is followed by
  EOS, so the warm-started model stops where the RL reward expects it to.
- The validation prompts never reach SFT training and are not the RL run's test prompts: a built-in task's
  validation split is disjoint from its train and test splits; from a data file the rows whose prompt falls in
  the validation part of the fixed partition are carved out of the training rows (`carve_validation`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncflow.algos.losses import sft_loss
from asyncflow.config import Config, ConfigError
from asyncflow.data import Example
from asyncflow.data.prompts import open_task
from asyncflow.data.tasks import carve_validation
from asyncflow.engines.base import ShardedCheckpointing, TrainEngine, make_train_engine
from asyncflow.models.loading import load_tokenizer, model_with_weights, render_prompt, resolve_model_path
from asyncflow.models.logprobs import TrainSample, response_mask
from asyncflow.models.tri_model import TriLogProbs
from asyncflow.observe import MetricsLogger, TrainProgress
from asyncflow.runtime.base import build_generating_worker
from asyncflow.workers.reward import RewardWorker
from asyncflow.workflow.checkpoint import (
    SHARDED_DIR,
    STEP_PREFIX,
    CheckpointError,
    CheckpointWriteError,
    checkpoint_step,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
    write_failure,
)
from asyncflow.workflow.evaluation import evaluate, evaluation_spec
from asyncflow.workflow.kinds import EnvironmentKind, environment_kind
from asyncflow.workflow.run_folder import DAMAGED_PREFIX
from asyncflow.workflow.setup import (
    Preflight,
    build_reward_runner,
    datasets,
    multiturn_spec,
    prompt_encoder,
    rollout_spec,
    sampling_params,
    seed_everything,
    train_engine_options,
)
from asyncflow.workflow.stopping import StopSignals

log = logging.getLogger(__name__)

SUMMARY_FILE = "sft_summary.json"


def sft_pools(config: Config, train: list[Example] | None = None) -> tuple[list[Example], list[Example]]:
    """(training rows, validation rows) of SFT from `train` (default: the config's training set). Validation is
    empty without `sft.stop_accuracy`."""
    train = datasets(config)[0].examples if train is None else train
    if config.sft.stop_accuracy is None:
        return train, []
    size = config.sft.validation_size
    if config.data.task and not config.data.path:
        task = open_task(config.data, config.run.seed)
        validation = task.examples("validation")[:size]  # a task may have fewer validation prompts
    else:
        train, validation = carve_validation(train, size)
    if not validation:
        raise ValueError(
            "sft.stop_accuracy is set but there are no validation prompts (rows of data.path whose prompt falls in "
            "the validation part of the fixed partition, about 5% of distinct prompts): unset sft.stop_accuracy"
        )
    if not train:
        raise ValueError("no SFT training rows are left after carving out the validation prompts")
    return train, validation


class ValidationProbe:
    """Greedy accuracy of the policy on the validation rows, measured as the RL run measures its held-out accuracy,
    on a rollout engine of its own, built as the run's replicas are (weights loaded per check)."""

    def __init__(self, config: Config, model_path: Path, tokenizer, validation: list[Example], env: EnvironmentKind):
        self.validation, self.version = validation, 0
        self.params = sampling_params(config, tokenizer, greedy=True)
        spec = evaluation_spec(rollout_spec(config, model_path, tokenizer, env), self.params)
        self.worker = build_generating_worker(spec)
        self.episodes = self.worker if spec.multiturn is not None else None
        self.rewards = RewardWorker(build_reward_runner(config, env), tokenizer)
        self.encoder = prompt_encoder(config, tokenizer, env)

    def accuracy(self, weights: Mapping[str, torch.Tensor]) -> float:
        self.version += 1
        self.worker.engine.update_weights(weights, self.version)
        result = evaluate(self.worker.engine, self.rewards, self.encoder, self.validation, self.params,
                          episodes=self.episodes)
        return float(result.get("eval/accuracy", 0.0))

    def close(self) -> None:
        try:
            self.worker.close()
        finally:
            self.rewards.close()


def sft_samples(config: Config, tokenizer, env: EnvironmentKind | None = None) -> Callable[[Example], TrainSample]:
    """Example -> its SFT sample: the rendered prompt and the answer followed by EOS; with `env.name` its tool-use
    demonstration (the environment's `demonstration(row)` turns, played through the episode runner, so the ids and
    loss mask are those a rollout would produce: only the model's turns are trained)."""
    env = env or environment_kind(config)
    spec = multiturn_spec(config, env)
    if spec is None:
        encoded: dict[tuple[str, str], TrainSample] = {}  # each row is drawn many times: tokenized once

        def plain(example: Example) -> TrainSample:
            key = (example.prompt, example.answer)
            if key not in encoded:
                encoded[key] = TrainSample(
                    render_prompt(tokenizer, example.prompt, config.model.use_chat_template),
                    tokenizer(example.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id],
                )
            return encoded[key]

        return plain
    runner = spec.build(tokenizer, sampling_params(config, tokenizer))
    render = env.render(tokenizer)  # as the rollout renders (an agent's chat call with tools)
    cache: dict[str, TrainSample] = {}

    def to_sample(example: Example) -> TrainSample:
        if example.prompt not in cache:
            row = {"answer": example.answer, **example.metadata}
            turns = getattr(runner.make_env(), "demonstration", lambda _row: None)(row)
            if not turns:
                raise ValueError(f"env.name={spec.env!r} gives no demonstration for {example.source or 'a row'}: "
                                 "SFT before RL needs one (an environment's demonstration(row) method)")
            prompt_ids = render(example.prompt)
            episode = runner.demonstration(prompt_ids, row, turns)
            if episode.reward < 1.0:
                raise ValueError(f"the demonstration of {example.source or 'a row'} does not solve it "
                                 f"(reward {episode.reward}): {turns!r}")
            cache[example.prompt] = TrainSample(prompt_ids, episode.response_ids, loss_mask=episode.loss_mask)
        return cache[example.prompt]

    return to_sample


@dataclass(frozen=True)
class SFTLoss:
    """`sft_loss` as a picklable `RowLoss`, over the whole step's trained tokens (micro-batches and ranks add up)."""

    total_tokens: int

    def __call__(self, out: TriLogProbs) -> tuple[torch.Tensor, dict[str, float]]:
        return sft_loss(out.policy.logprobs, out.policy.mask, self.total_tokens), {}

    def select(self, rows: Sequence[int]) -> SFTLoss:
        return self


def run_sft(config: Config, output: str | Path, stop: StopSignals | None = None,
            checked: Preflight | None = None) -> Path:
    """Fine-tune `config.model.path` on the training split until `sft.stop_accuracy` (or `sft.steps`); save model +
    tokenizer + `sft_summary.json` to `output`, with `metrics.jsonl` and `checkpoints/` (replacing an `output`
    that an earlier SFT left incomplete). `stop`: the command's signal handlers, looked at after each step;
    `checked`: what `preflight` read of the config (its data and environment kind are not read again)."""
    cfg, final = config.sft, Path(output)
    if final.is_dir() and any(final.iterdir()) and read_summary(final) is None:
        if not any((final / name).exists() for name in ("metrics.jsonl", "checkpoints", "config.json")):
            raise ConfigError(f"SFT output {final} is not empty and holds no SFT model: choose a new folder")
        log.warning("%s holds no %s (an SFT that was cut off): SFT runs again", final, SUMMARY_FILE)
    output = final.parent / f".tmp_{final.name}"
    seed_everything(config.run.seed)
    model_path = resolve_model_path(config.model.path, seed=config.run.seed)
    tokenizer = load_tokenizer(model_path)
    env = checked.env if checked is not None else environment_kind(config)
    train, validation = sft_pools(config, checked.train_set.examples if checked is not None else None)
    settings = sft_settings(config, train, validation)
    resume_from = _resumable(output, settings)
    if resume_from is None:
        shutil.rmtree(output, ignore_errors=True)  # an interrupted SFT's without a usable checkpoint: started again
        output.mkdir(parents=True)
    probe = ValidationProbe(config, model_path, tokenizer, validation, env) if validation else None
    engine = make_train_engine(config.train.engine, **{  # SFT's optimizer; unpacked: its rows share no prompt
        **train_engine_options(config, model_path), "lr": cfg.lr, "betas": cfg.betas, "total_steps": cfg.steps,
        "weight_decay": cfg.weight_decay, "grad_clip": cfg.grad_clip, "lr_schedule": cfg.lr_schedule,
        "warmup_steps": cfg.warmup_steps, "use_reference": False, "packing": "off", "critic": None})  # no critic in SFT
    rng, to_sample = random.Random(config.run.seed), sft_samples(config, tokenizer, env)
    sharded = engine.save_sharded if isinstance(engine, ShardedCheckpointing) else None
    checks: list[tuple[int, float]] = []  # (step, validation accuracy)
    reached, step, wall_offset = False, 0, 0.0
    if resume_from is not None:
        step, checks, reached, wall_offset = _resume(engine, rng, resume_from)
        if probe is not None:
            probe.version = len(checks)
    t0 = time.perf_counter() - wall_offset
    metrics = MetricsLogger(output, tensorboard=False, resume_from_step=step)

    def save() -> None:
        state = {"phase": "sft", "sft_settings": settings, "sampler": rng.getstate(), "checks": checks,
                 "reached": reached, "wall_s": time.perf_counter() - t0}
        save_checkpoint(output, step, engine.state_dict(), engine.training_state(), state,
                        keep=config.checkpoint.keep, write_sharded=sharded)

    try:
        with TrainProgress(cfg.steps, initial=step, description="sft", enabled=config.run.progress) as bar:
            while step < cfg.steps and not reached:
                samples = [to_sample(train[rng.randrange(len(train))]) for _ in range(cfg.batch_size)]
                loss, total = 0.0, int(response_mask(samples).sum())
                for i in range(0, len(samples), config.train.micro_batch_size):
                    micro_batch = samples[i:i + config.train.micro_batch_size]
                    loss += engine.backward_micro_batch(micro_batch, SFTLoss(total))["loss"]
                row = {f"sft/{name}": value for name, value in {"loss": loss, **engine.optimizer_step()}.items()}
                step += 1
                if probe is not None and (step % cfg.check_every == 0 or step == cfg.steps):
                    checks.append((step, probe.accuracy(engine.state_dict())))
                    row["sft/val_accuracy"] = checks[-1][1]
                    reached = cfg.stop_accuracy is not None and checks[-1][1] >= cfg.stop_accuracy
                metrics.log(step, row)
                bar.update(step, {k: v for k, v in row.items() if k in ("sft/loss", "sft/val_accuracy")})
                stopping = stop is not None and stop.requested
                if (step == cfg.steps or reached or stopping
                        or config.checkpoint.every and step % config.checkpoint.every == 0):
                    save()
                if stopping and stop is not None:
                    raise stop.stopped(f"during SFT (step {step}): the SFT model is not written; SFT continues from "
                                       "this step's checkpoint when run again")
        # under LoRA the merged weights: a plain model folder; the engine's tensors, not a second copy of them
        model = model_with_weights(model_path, engine.state_dict(), dtype=config.model.dtype)
    finally:
        metrics.close()
        engine.close()
        if probe is not None:
            probe.close()
    wall_s = time.perf_counter() - t0
    summary = {
        "steps": step, "max_steps": cfg.steps, "stop_accuracy": cfg.stop_accuracy,
        "reached": reached if probe is not None else None, "val_accuracy": checks[-1][1] if checks else None,
        "validation_size": len(validation), "check_every": cfg.check_every if probe is not None else None,
        "checks": [{"step": s, "val_accuracy": a} for s, a in checks], "wall_s": round(wall_s, 2),
        "torch_threads": torch.get_num_threads(),
    }  # fmt: skip
    try:
        model.save_pretrained(output)
        tokenizer.save_pretrained(output)
        (output / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    except Exception as err:  # safetensors, the OS, ...: one line; the last checkpoint lets SFT finish when run again
        code, cause = write_failure(err, output)
        raise CheckpointWriteError(code, f"{cause} while writing the SFT model into {output}; its checkpoint of step "
                                   f"{step} is intact: SFT run again finishes from it") from err
    if final.exists():
        shutil.rmtree(final)
    output.rename(final)
    if probe is not None and not reached:
        log.warning("SFT reached sft.steps=%d without validation accuracy >= sft.stop_accuracy=%s (best %.3f, last "
                    "%.3f): RL starts from a weaker model than intended; raise sft.steps or sft.lr, or lower "
                    "sft.stop_accuracy", step, cfg.stop_accuracy, max(a for _, a in checks), summary["val_accuracy"])
    log.info("SFT stopped at step %d (%.1f s), validation accuracy %s; model saved to %s", step, wall_s,
             summary["val_accuracy"], final)
    return final


def sft_settings(config: Config, train: list[Example], validation: list[Example]) -> dict:
    """What an SFT checkpoint must have been trained with to be continued: SFT's own settings, the model, engine,
    LoRA, micro-batch and seed, and a sha256 over the training and validation rows (JSON-plain, to compare)."""
    digest = hashlib.sha256()
    for example in [*train, None, *validation]:
        if example is None:
            digest.update(b"|")  # where the training rows end
        else:
            digest.update(f"{len(example.prompt)}:{example.prompt}{len(example.answer)}:{example.answer}".encode())
    sft = config.sft.model_dump(mode="json", exclude={"output", "before_rl"})
    settings = {"sft": sft, "model.path": config.model.path, "train.engine": config.train.engine,
                "train.world_size": config.train.world_size, "train.lora": config.train.lora.model_dump(mode="json"),
                "train.micro_batch_size": config.train.micro_batch_size, "run.seed": config.run.seed,
                "data": {"train": len(train), "validation": len(validation), "sha256": digest.hexdigest()}}
    return json.loads(json.dumps(settings))


def _resumable(output: Path, settings: dict) -> Path | None:
    """The newest intact checkpoint of an interrupted SFT in `output` trained with `settings`, or None (SFT starts
    again: none, or the settings or data changed, said in a warning). Damaged ones are set aside (`damaged_step_N`),
    half-written ones removed."""
    found = list_checkpoints(output)
    for half_written in (output / "checkpoints").glob(f".tmp_{STEP_PREFIX}*"):
        shutil.rmtree(half_written, ignore_errors=True)
    for checkpoint in reversed(found):
        try:
            verify_checkpoint(checkpoint)
        except CheckpointError as err:
            aside = checkpoint.with_name(DAMAGED_PREFIX + checkpoint.name)
            shutil.rmtree(aside, ignore_errors=True)
            checkpoint.rename(aside)
            log.warning("SFT checkpoint %s is damaged (%s): set aside as %s", checkpoint, err, aside)
            continue
        recorded = json.loads((checkpoint / "state.json").read_text()).get("sft_settings")
        if recorded != settings:
            changed = ", ".join(k for k in settings if (recorded or {}).get(k) != settings[k]) if recorded else (
                "it records no SFT settings: written by an older asyncflow")
            log.warning("SFT changed since its checkpoint %s (%s): SFT starts again from step 0", checkpoint, changed)
            return None
        log.info("SFT continues from %s (step %d)", checkpoint, checkpoint_step(checkpoint))
        return checkpoint
    if found:
        log.warning("no intact SFT checkpoint in %s: SFT starts again from step 0", output / "checkpoints")
    return None


def _resume(engine: TrainEngine, rng: random.Random,
            checkpoint: Path) -> tuple[int, list[tuple[int, float]], bool, float]:
    """Restore the engine (weights, optimizer, schedule), the global RNGs and the example sampler from an SFT
    checkpoint; -> (step, checks, reached, wall seconds so far)."""
    weights, training_state, state, _ = load_checkpoint(checkpoint)
    sharded = checkpoint / SHARDED_DIR
    if isinstance(engine, ShardedCheckpointing) and sharded.is_dir():
        engine.load_sharded(sharded)
        engine.load_training_state(training_state)
    else:
        engine.load_checkpoint(weights, training_state)
    version, internal, gauss = state["sampler"]
    rng.setstate((version, tuple(internal), gauss))
    checks = [(int(s), float(a)) for s, a in state["checks"]]
    return int(state["step"]), checks, bool(state["reached"]), float(state["wall_s"])


def read_summary(folder: str | Path) -> dict | None:
    """The `sft_summary.json` of an SFT output folder, or None when it has none (no complete SFT there)."""
    path = Path(folder) / SUMMARY_FILE
    return json.loads(path.read_text()) if path.exists() else None
