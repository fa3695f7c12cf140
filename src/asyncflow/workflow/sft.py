"""Supervised warm-up: train on (prompt, answer) pairs so a tiny random model starts RL with a
non-zero reward.

Owns: the SFT loop (cross-entropy on answer tokens only, AdamW with warm-up then a constant or
decaying LR), its stopping rule, and saving the result as an ordinary Hugging Face folder that
`model.path` can point at, with `sft_summary.json` beside the weights.

With `env.name` (multi-turn), SFT trains on the environment's tool-use demonstrations (model turns and
tool outputs as ids, only the model's turns in the loss), and validation runs episodes.

Stopping rule: with `sft.stop_accuracy` set, every `sft.check_every` steps (and at `sft.steps`) the
model's greedy accuracy is measured on the validation split, exactly as the RL run measures its
held-out accuracy (same inference engine, sampling parameters and rewards; a sample counts when its
reward is >= 1), and SFT stops at the first check that reaches the target. `sft.steps` bounds the
run; ending there below the target logs a warning. Without `stop_accuracy`, SFT runs `sft.steps`.

Invariants:
- The prompt is rendered exactly as the RL rollout renders it (`render_prompt`) and the answer is
  followed by EOS, so the warm-started model stops where the RL reward expects it to.
- The validation prompts never reach SFT training and are not the test prompts the RL run reports:
  a built-in task's validation split is disjoint from its train and test splits; from a data file
  the rows whose prompt falls in the validation part of the fixed partition are carved out of the
  training rows (`asyncflow.data.tasks.carve_validation`).
"""

from __future__ import annotations

import copy
import json
import logging
import random
import time
from pathlib import Path
from typing import Callable

import torch

from asyncflow.config import Config
from asyncflow.data import Example, make_task
from asyncflow.data.tasks import carve_validation
from asyncflow.engines.base import make_inference_engine
from asyncflow.engines.torch_train import lr_lambda
from asyncflow.models.loading import load_model, load_tokenizer, render_prompt, resolve_model_path
from asyncflow.models.logprobs import TrainSample, response_logprobs
from asyncflow.observe.progress import TrainProgress
from asyncflow.workers.multiturn import make_rollout_worker
from asyncflow.workers.reward import RewardWorker
from asyncflow.workflow.evaluation import evaluate
from asyncflow.workflow.setup import (
    build_reward_runner, datasets, multiturn_spec, prompt_encoder, sampling_params, seed_everything,
)

log = logging.getLogger(__name__)

SUMMARY_FILE = "sft_summary.json"


def sft_pools(config: Config) -> tuple[list[Example], list[Example]]:
    """(training rows, validation rows) of SFT. Validation is empty without `sft.stop_accuracy`."""
    train_set, _ = datasets(config)
    train = train_set.examples
    if config.sft.stop_accuracy is None:
        return train, []
    size = config.sft.validation_size
    if config.data.task and not config.data.path:
        task = make_task(config.data.task, difficulty=config.data.difficulty, seed=config.run.seed)
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
    """Greedy accuracy of a model on the validation rows, measured the way the RL run measures its
    held-out accuracy, on an inference engine of its own (a copy of the model, weights loaded per check)."""

    def __init__(self, config: Config, model: torch.nn.Module, tokenizer, validation: list[Example]):
        self.validation = validation
        self.engine = make_inference_engine(
            config.rollout.engine, model=copy.deepcopy(model).eval().requires_grad_(False),
            max_batch_size=config.rollout.max_batch_size, device=config.model.device, seed=config.run.seed,
        )
        self.rewards = RewardWorker(build_reward_runner(config), tokenizer)
        self.encoder = prompt_encoder(config, tokenizer)
        self.params = sampling_params(config, tokenizer, greedy=True)
        spec = multiturn_spec(config)
        self.episodes = None if spec is None else make_rollout_worker(
            self.engine, self.params, 1, multiturn=spec, tokenizer=tokenizer
        )
        self.version = 0

    def accuracy(self, model: torch.nn.Module) -> float:
        self.version += 1
        self.engine.update_weights(model.state_dict(), self.version)
        result = evaluate(self.engine, self.rewards, self.encoder, self.validation, self.params,
                          episodes=self.episodes)
        return float(result.get("eval/accuracy", 0.0))


def demonstration_samples(config: Config, tokenizer) -> Callable[[Example], TrainSample] | None:
    """With `env.name`: example -> the SFT sample of its tool-use demonstration (the environment's
    `demonstration(row)` turns, played through the episode runner, so the ids and loss mask are those a
    rollout would produce: only the model's turns are trained). None without an environment."""
    spec = multiturn_spec(config)
    if spec is None:
        return None
    runner = spec.build(tokenizer, sampling_params(config, tokenizer))
    cache: dict[str, TrainSample] = {}

    def to_sample(example: Example) -> TrainSample:
        if example.prompt not in cache:
            row = {"answer": example.answer, **example.metadata}
            turns = getattr(runner.make_env(), "demonstration", lambda _row: None)(row)
            if not turns:
                raise ValueError(f"env.name={spec.env!r} gives no demonstration for {example.source or 'a row'}: "
                                 "SFT before RL needs one (an environment's demonstration(row) method)")
            prompt_ids = render_prompt(tokenizer, example.prompt, config.model.use_chat_template)
            episode = runner.demonstration(prompt_ids, row, turns)
            if episode.reward < 1.0:
                raise ValueError(f"the demonstration of {example.source or 'a row'} does not solve it "
                                 f"(reward {episode.reward}): {turns!r}")
            cache[example.prompt] = TrainSample(prompt_ids, episode.response_ids, loss_mask=episode.loss_mask)
        return cache[example.prompt]

    return to_sample


def run_sft(config: Config, output: str | Path) -> Path:
    """Fine-tune `config.model.path` on the training split until `sft.stop_accuracy` (or `sft.steps`);
    save model + tokenizer + `sft_summary.json` to `output`."""
    cfg = config.sft
    seed_everything(config.run.seed)
    model_path = resolve_model_path(config.model.path, seed=config.run.seed)
    tokenizer = load_tokenizer(model_path)
    model = load_model(model_path, dtype=config.model.dtype, device=config.model.device)
    model.train()
    train, validation = sft_pools(config)
    probe = ValidationProbe(config, model, tokenizer, validation) if validation else None
    rng = random.Random(config.run.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.lr_schedule, cfg.warmup_steps, cfg.steps))
    use_chat = config.model.use_chat_template
    to_sample = demonstration_samples(config, tokenizer)
    checks: list[tuple[int, float]] = []
    reached = False
    step = 0
    t0 = time.perf_counter()
    with TrainProgress(cfg.steps, description="sft", enabled=config.run.progress) as bar:
        while step < cfg.steps and not reached:
            examples = [train[rng.randrange(len(train))] for _ in range(cfg.batch_size)]
            if to_sample is not None:
                samples = [to_sample(ex) for ex in examples]
            else:
                samples = [
                    TrainSample(
                        render_prompt(tokenizer, ex.prompt, use_chat),
                        tokenizer(ex.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id],
                    )
                    for ex in examples
                ]
            out = response_logprobs(model, samples)
            loss = -(out.logprobs * out.mask).sum() / out.mask.sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            metrics = {"sft/loss": float(loss.detach())}
            if probe is not None and (step % cfg.check_every == 0 or step == cfg.steps):
                accuracy = probe.accuracy(model)
                checks.append((step, accuracy))
                metrics["sft/val_accuracy"] = accuracy
                reached = accuracy >= cfg.stop_accuracy
            bar.update(step, metrics)
    wall_s = time.perf_counter() - t0
    summary = {
        "steps": step,
        "max_steps": cfg.steps,
        "stop_accuracy": cfg.stop_accuracy,
        "reached": reached if probe is not None else None,
        "val_accuracy": checks[-1][1] if checks else None,
        "validation_size": len(validation),
        "check_every": cfg.check_every if probe is not None else None,
        "checks": [{"step": s, "val_accuracy": a} for s, a in checks],
        "wall_s": round(wall_s, 2),
        "torch_threads": torch.get_num_threads(),
    }
    if probe is None:
        log.info("SFT ran %d steps (%.1f s)", step, wall_s)
    elif reached:
        log.info("SFT stopped at step %d: validation accuracy %.3f >= sft.stop_accuracy=%s (%.1f s)",
                 step, summary["val_accuracy"], cfg.stop_accuracy, wall_s)
    else:
        log.warning(
            "SFT reached sft.steps=%d without validation accuracy >= sft.stop_accuracy=%s (best %.3f, last %.3f): "
            "RL starts from a weaker model than intended; raise sft.steps or sft.lr, or lower sft.stop_accuracy",
            step, cfg.stop_accuracy, max(a for _, a in checks), summary["val_accuracy"],
        )
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    (output / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    log.info("SFT model saved to %s", output)
    return output


def read_summary(folder: str | Path) -> dict | None:
    """The `sft_summary.json` of an SFT output folder, or None when it has none."""
    path = Path(folder) / SUMMARY_FILE
    return json.loads(path.read_text()) if path.exists() else None
