"""Per-token log-probabilities of responses under a causal LM (the unpacked reference path).

Owns: `TrainSample` (a prompt and one response, token ids) and `response_logprobs`, which runs
the model on right-padded prompt+response sequences and returns log-probs aligned with response
tokens. The shared-prompt packed path (`asyncflow.models.packing`) must return exactly the same
tensors; this function is its reference.

Shapes: N samples, L = longest response in the micro-batch; outputs are `[N, L]`, right-padded,
with `mask [N, L]` marking real response tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from asyncflow.models.hf import causal_lm


@dataclass
class TrainSample:
    prompt_ids: list[int]
    response_ids: list[int]
    group_id: int = 0  # responses of one GRPO group share the prompt (used by packing)
    loss_mask: list[int] | None = None  # per response token, 1 = trained (model-sampled); None = all trained
    routed_experts: torch.Tensor | None = None  # [S, layers, k] the rollout's experts per position (router replay)


@dataclass
class LogProbs:
    logprobs: torch.Tensor  # [N, L] float32
    mask: torch.Tensor  # [N, L] bool
    entropy: torch.Tensor | None = None  # [N, L] float32, when requested
    hidden: torch.Tensor | None = None  # [N, L, H] the lm_head's input predicting each token, when requested


def response_mask(samples: list[TrainSample], device: torch.device | str | None = None) -> torch.Tensor:
    """`[N, L]` bool mask of trained response tokens: real (not padding) and, where a sample has a `loss_mask`,
    marked 1 there (a multi-turn episode's tool and template tokens are 0: no loss, KL or entropy on them)."""
    lengths = torch.tensor([len(s.response_ids) for s in samples], device=device)
    mask = torch.arange(int(lengths.max()), device=device)[None, :] < lengths[:, None]
    for i, s in enumerate(samples):
        if s.loss_mask is not None:
            if len(s.loss_mask) != len(s.response_ids):
                raise ValueError(f"sample {i}: loss_mask has {len(s.loss_mask)} entries for "
                                 f"{len(s.response_ids)} response tokens")
            mask[i, : len(s.loss_mask)] &= torch.tensor(s.loss_mask, device=device).bool()
    return mask


def gather_token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T)[target] and optionally the entropy. logits `[..., V]`, targets `[...]`."""
    logits = logits.float() / temperature
    log_z = torch.logsumexp(logits, dim=-1)
    token_logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_z
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = log_z - (probs * logits).sum(-1)
    return token_logprobs, entropy


@contextmanager
def lm_head_input(model: torch.nn.Module, enabled: bool = True) -> Iterator[dict[str, torch.Tensor]]:
    """Yields a dict whose `hidden` is, after a forward of `model`, the input of its output layer (the final
    hidden states the logits are computed from, already sliced by `logits_to_keep`)."""
    captured: dict[str, torch.Tensor] = {}
    if not enabled:
        yield captured
        return
    handle = causal_lm(model).get_output_embeddings().register_forward_pre_hook(
        lambda module, args: captured.__setitem__("hidden", args[0])
    )
    try:
        yield captured
    finally:
        handle.remove()


def padded_rows(
    samples: list[TrainSample], device: torch.device | str | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt + response ids `[N, T]`, their attention mask `[N, T]` (1 on real tokens), the trained
    response tokens `[N, L]` (`response_mask`) and the position predicting each response token `[N, L]`: response
    token j of sample i sits at position P_i + j and is predicted by position P_i + j - 1 (clamped below T)."""
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    input_ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for i, seq in enumerate(seqs):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
    mask = response_mask(samples, device)
    prompt_lens = torch.tensor([len(s.prompt_ids) for s in samples], device=device)
    positions = prompt_lens[:, None] - 1 + torch.arange(mask.shape[1], device=device)[None, :]
    return input_ids.to(device), attention.to(device), mask, positions.clamp(max=input_ids.shape[1] - 1)


def masked_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, temperature: float, with_entropy: bool,
    hidden: torch.Tensor | None = None,
) -> LogProbs:
    """`LogProbs` of `targets [N, L]` under `logits [N, L, V]`, 0 where `mask [N, L]` is false."""
    logprobs, entropy = gather_token_logprobs(logits, targets, temperature, with_entropy)
    if entropy is not None:
        entropy = entropy.masked_fill(~mask, 0.0)
    return LogProbs(logprobs.masked_fill(~mask, 0.0), mask, entropy, hidden)


def response_logprobs(
    model: torch.nn.Module,
    samples: list[TrainSample],
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    with_hidden: bool = False,
) -> LogProbs:
    """Log-probs of each response token given its prompt and the preceding response tokens.

    Runs one forward over `[N, T]` right-padded `prompt + response` sequences (T = longest). `with_hidden`: also
    the hidden state `[N, L, H]` whose logits predict each response token (for a value head).
    """
    if not samples:
        raise ValueError("response_logprobs needs at least one sample")
    input_ids, attention, mask, positions = padded_rows(samples, next(model.parameters()).device)
    with lm_head_input(model, with_hidden) as captured:
        logits = model(input_ids=input_ids, attention_mask=attention).logits  # [N, T, V]
    hidden = None
    if with_hidden:
        h = captured["hidden"]
        hidden = h.gather(1, positions.unsqueeze(-1).expand(-1, -1, h.shape[-1]))  # [N, L, H]
    picked = logits.gather(1, positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))  # [N, L, V]
    targets = input_ids.gather(1, (positions + 1).clamp(max=input_ids.shape[1] - 1))
    return masked_logprobs(picked, targets, mask, temperature, with_entropy, hidden)
