"""Supervised warm-up: train on (prompt, answer) pairs so a tiny random model starts RL with a
non-zero reward.

Owns: the SFT loop (cross-entropy on answer tokens only, AdamW with cosine decay) and saving
the result as an ordinary Hugging Face folder that `model.path` can point at.

Invariant: the prompt is rendered exactly as the RL rollout renders it (`render_prompt`) and the
answer is followed by EOS, so the warm-started model stops where the RL reward expects it to.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import torch

from asyncflow.config import Config
from asyncflow.engines.torch_train import lr_lambda
from asyncflow.models.loading import load_model, load_tokenizer, render_prompt, resolve_model_path
from asyncflow.models.logprobs import TrainSample, response_logprobs
from asyncflow.observe.progress import TrainProgress
from asyncflow.workflow.setup import datasets, seed_everything

log = logging.getLogger(__name__)


def run_sft(config: Config, output: str | Path) -> Path:
    """Fine-tune `config.model.path` on the training split; save model + tokenizer to `output`."""
    seed_everything(config.run.seed)
    model_path = resolve_model_path(config.model.path, seed=config.run.seed)
    tokenizer = load_tokenizer(model_path)
    model = load_model(model_path, dtype=config.model.dtype, device=config.model.device)
    model.train()
    train_set, _ = datasets(config)
    rng = random.Random(config.run.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.sft.lr, betas=(0.9, 0.98), weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda("cosine", 10, config.sft.steps))
    use_chat = config.model.use_chat_template
    with TrainProgress(config.sft.steps, description="sft", enabled=config.run.progress) as bar:
        for step in range(config.sft.steps):
            examples = [train_set.sample(rng) for _ in range(config.sft.batch_size)]
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
            bar.update(step + 1, {"sft/loss": float(loss.detach())})
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    log.info("SFT model saved to %s", output)
    return output
