"""Shared-prompt packing: a GRPO group runs as its prompt once followed by its G responses.

Owns: `packed_response_logprobs` (same contract as `asyncflow.models.logprobs.response_logprobs`:
same sample order, `[N, L]` aligned, padded entries 0), the grouping rule `group_runs`, the index
plan `SharedPromptLayout`, and the attention function `shared_prompt_attention`, registered with
transformers' `AttentionInterface` as "asyncflow_shared_prompt" (no modelling code is forked).

Layout: all groups of a micro-batch are concatenated into ONE row of T tokens,
`[prompt_0, resp_0_0, ..., resp_0_G0, prompt_1, resp_1_0, ...]`; there is no padding in the
token dimension, so the MLPs and projections see each prompt once. Position ids restart at 0 for
each prompt and every response continues from its prompt's end (P, P+1, ...), exactly the
positions it has in the unpacked sequence (RoPE has no absolute position limit).

Attention never materialises a T x T mask. Per layer it runs two batched calls over gathered
keys/values ("index gather"): prompts attend causally to themselves (`[groups, Pmax]`), and each
response's queries attend to `[its prompt ; itself]` (`[N, Pmax + Rmax]` keys) with the causal
part bottom-right aligned. This costs `G*R*(P+R)` per group instead of `(P+G*R)^2` for a dense
block mask (`benchmarks/bench_packing.py --dense` compares the two).
On CUDA with `flash_attn` installed and half precision, one `flash_attn_varlen_func` call does
the same without padding (cu_seqlens over query segments, causal bottom-right); otherwise SDPA.

Logits: response token j of sample i is predicted by the hidden state before it; for j = 0 that
is the LAST PROMPT position, shared by all G responses of the group, so the lm_head is applied to
an `[N, L]` gather of hidden states (`logits_to_keep`, duplicates allowed) and never to prompts.

Invariants: samples are grouped by runs of consecutive equal `group_id`; a group id seen with two
different prompts is an error (`PackingError`). Prompts are non-empty (the last prompt position
predicts the first response token). The model's attention implementation is switched only for
the duration of one call (do not run another forward of the same module concurrently), unless
`keep_shared_prompt_attention` pinned it: activation checkpointing recomputes a layer in the backward,
after the call returned, and the recompute must run the same attention as the forward.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from asyncflow.models.hf import causal_lm
from asyncflow.models.logprobs import LogProbs, TrainSample, lm_head_input, masked_logprobs
from asyncflow.models.logprobs import response_mask as trained_token_mask

try:  # CUDA-only varlen kernel; absent on CPU machines.
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_varlen_func = None

ATTENTION_NAME = "asyncflow_shared_prompt"


class PackingError(ValueError):
    """Samples that cannot be packed as shared-prompt groups."""


def group_runs(samples: list[TrainSample]) -> list[tuple[int, int]]:
    """`[start, end)` index ranges of consecutive samples with equal `group_id` (one packed group each).

    Raises `PackingError` when a group id is used with two different prompts, or a prompt or a
    response is empty.
    """
    if not samples:
        raise PackingError("packing needs at least one sample")
    prompt_of_group: dict[int, list[int]] = {}
    runs: list[tuple[int, int]] = []
    for i, sample in enumerate(samples):
        if not sample.prompt_ids:
            raise PackingError(f"sample {i} has an empty prompt; its last token must predict the first response token")
        if not sample.response_ids:
            raise PackingError(f"sample {i} has an empty response")
        seen = prompt_of_group.setdefault(sample.group_id, sample.prompt_ids)
        if seen != sample.prompt_ids:
            raise PackingError(
                f"group_id {sample.group_id} is used with different prompts (sample {i}); responses packed as one "
                f"group must share their prompt token for token, so give each prompt its own group_id"
            )
        if runs and samples[runs[-1][0]].group_id == sample.group_id and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


@dataclass
class SharedPromptLayout:
    """Index plan of one packed micro-batch: T tokens, `groups` prompts, N responses, L = longest response.

    Padded slots of index tensors point at token 0 and are masked out (or their outputs dropped).
    """

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    prompt_index: torch.Tensor  # [groups, Pmax] token index of each prompt slot (right-padded)
    response_query_index: torch.Tensor  # [N, Rmax] token index of each response slot
    response_key_index: torch.Tensor  # [N, Pmax + Rmax] its group's prompt slots, then its own slots
    response_mask: torch.Tensor  # [N, 1, Rmax, Pmax + Rmax] bool: whole prompt + causal self
    output_index: torch.Tensor  # [T] row of token t in cat(prompt outputs, response outputs) flattened
    predictor_index: torch.Tensor  # [N, L] token whose logits predict response token j
    targets: torch.Tensor  # [N, L] response token ids (0 where padded)
    mask: torch.Tensor  # [N, L] bool
    # flash-attention varlen plan: query segments are contiguous token ranges in order.
    varlen_key_index: torch.Tensor  # [sum of key segment lengths]
    cu_seqlens_q: torch.Tensor  # [segments + 1] int32
    cu_seqlens_k: torch.Tensor  # [segments + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int


def plan_shared_prompt(samples: list[TrainSample], device: torch.device | str = "cpu") -> SharedPromptLayout:
    """Build the packed token row and every index the attention and logit gathers need."""
    runs = group_runs(samples)
    prompt_lens = [len(samples[start].prompt_ids) for start, _ in runs]
    response_lens = [len(s.response_ids) for s in samples]
    p_max, r_max, n = max(prompt_lens), max(response_lens), len(samples)

    # Built as Python lists and converted once: a few tensor ops per sample would cost more than the forward saves.
    tokens: list[int] = []
    positions: list[int] = []
    prompt_index = [[0] * p_max for _ in runs]
    response_query_index = [[0] * r_max for _ in range(n)]
    response_key_index = [[0] * (p_max + r_max) for _ in range(n)]
    output_index: list[int] = []
    varlen_keys: list[int] = []
    q_lens: list[int] = []
    k_lens: list[int] = []
    predictor_index = [[0] * r_max for _ in range(n)]
    targets = [[0] * r_max for _ in range(n)]
    response_base = len(runs) * p_max  # first response row in the flattened attention outputs
    for g, (start, end) in enumerate(runs):
        prompt = samples[start].prompt_ids
        p = len(prompt)
        prompt_start = len(tokens)
        prompt_slots = list(range(prompt_start, prompt_start + p))
        prompt_index[g][:p] = prompt_slots
        tokens += prompt
        positions += range(p)
        output_index += range(g * p_max, g * p_max + p)
        varlen_keys += prompt_slots
        q_lens.append(p)
        k_lens.append(p)
        for i in range(start, end):
            response = samples[i].response_ids
            r = len(response)
            response_slots = list(range(len(tokens), len(tokens) + r))
            response_query_index[i][:r] = response_slots
            response_key_index[i][:p] = prompt_slots
            response_key_index[i][p_max : p_max + r] = response_slots
            predictor_index[i][0] = prompt_start + p - 1
            predictor_index[i][1:r] = response_slots[:-1]
            targets[i][:r] = response
            tokens += response
            positions += range(p, p + r)
            output_index += range(response_base + i * r_max, response_base + i * r_max + r)
            varlen_keys += prompt_slots + response_slots
            q_lens.append(r)
            k_lens.append(p + r)

    prompt_len_t = torch.tensor(prompt_lens)
    group_of_sample = torch.tensor([g for g, (start, end) in enumerate(runs) for _ in range(start, end)])
    key_pos = torch.arange(p_max + r_max)
    r_pos = torch.arange(r_max)
    sees_prompt = key_pos[None, None, :] < prompt_len_t[group_of_sample][:, None, None]  # [N, 1, K]
    sees_self = (key_pos[None, :] >= p_max) & (key_pos[None, :] - p_max <= r_pos[:, None])  # [Rmax, K]
    response_mask = (sees_prompt | sees_self[None])[:, None]
    mask = trained_token_mask(samples)  # real response tokens, less those a loss mask leaves out

    def cu(lengths: list[int]) -> torch.Tensor:
        return F.pad(torch.tensor(lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))

    return SharedPromptLayout(
        input_ids=torch.tensor(tokens, device=device)[None],
        position_ids=torch.tensor(positions, device=device)[None],
        prompt_index=torch.tensor(prompt_index, device=device),
        response_query_index=torch.tensor(response_query_index, device=device),
        response_key_index=torch.tensor(response_key_index, device=device),
        response_mask=response_mask.to(device=device),
        output_index=torch.tensor(output_index, device=device),
        predictor_index=torch.tensor(predictor_index, device=device),
        targets=torch.tensor(targets, device=device),
        mask=mask.to(device=device),
        varlen_key_index=torch.tensor(varlen_keys, dtype=torch.long, device=device),
        cu_seqlens_q=cu(q_lens).to(device=device),
        cu_seqlens_k=cu(k_lens).to(device=device),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(k_lens),
    )


def _gathered_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_index: torch.Tensor,
    key_index: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """SDPA over gathered segments. q `[T, H, D]`, k/v `[T, Hkv, D]`, indices `[S, Q]`/`[S, K]` -> `[S, Q, H, D]`.

    `mask=None` means plain causal: exact for right-padded prompts, since a real query never sees a
    later (padded) key and the outputs of padded queries are dropped (zero gradient).
    """
    def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        # index_select: its backward (index_add) is much cheaper on CPU than x[index]'s
        rows: torch.Tensor = x.index_select(0, index.flatten()).unflatten(0, index.shape)
        return rows.transpose(1, 2)

    out = F.scaled_dot_product_attention(
        gather(q, query_index),
        gather(k, key_index),
        gather(v, key_index),
        attn_mask=mask,
        is_causal=mask is None,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(1, 2)


def shared_prompt_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    shared_prompt_layout: SharedPromptLayout | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query `[1, H, T, D]`, key/value `[1, Hkv, T, D]` -> `[1, T, H, D]`.
    Without a layout (an unpacked forward of a model pinned by `keep_shared_prompt_attention`) it is SDPA."""
    layout = shared_prompt_layout
    if layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1 or query.shape[2] != layout.input_ids.shape[1]:
        raise RuntimeError(f"packed attention expects one row of {layout.input_ids.shape[1]} tokens, "
                           f"got {tuple(query.shape)}")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, D]
    if flash_attn_varlen_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        keys = layout.varlen_key_index
        out = flash_attn_varlen_func(
            q, k.index_select(0, keys), v.index_select(0, keys),
            layout.cu_seqlens_q, layout.cu_seqlens_k, layout.max_seqlen_q, layout.max_seqlen_k,
            dropout_p=dropout, softmax_scale=scaling, causal=True,
        )  # causal is bottom-right aligned when a segment has more keys than queries
        return out[None], None
    prompt_out = _gathered_sdpa(q, k, v, layout.prompt_index, layout.prompt_index, None, scaling, dropout)
    response_out = _gathered_sdpa(
        q, k, v, layout.response_query_index, layout.response_key_index, layout.response_mask, scaling, dropout
    )
    flat = torch.cat([prompt_out.flatten(0, 1), response_out.flatten(0, 1)])  # [rows, H, D]
    return flat.index_select(0, layout.output_index)[None], None


AttentionInterface.register(ATTENTION_NAME, shared_prompt_attention)


def keep_shared_prompt_attention(model: torch.nn.Module) -> None:
    """Run every forward of `model` (an SDPA model) through `shared_prompt_attention`: packed calls with their
    layout, the others as SDPA. Needed when layers are recomputed in the backward (activation checkpointing)."""
    current = causal_lm(model).config._attn_implementation
    if current not in ("sdpa", ATTENTION_NAME):
        raise ValueError(f"shared-prompt packing with activation checkpointing needs the sdpa attention, not "
                         f"{current!r} (set train.packing=off)")
    causal_lm(model).set_attn_implementation(ATTENTION_NAME)


@contextmanager
def _attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    lm = causal_lm(model)
    previous = lm.config._attn_implementation
    if previous == name:
        yield
        return
    lm.set_attn_implementation(name)
    try:
        yield
    finally:
        lm.set_attn_implementation(previous)


def packed_response_logprobs(
    model: torch.nn.Module,
    samples: list[TrainSample],
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    layout: SharedPromptLayout | None = None,
    with_hidden: bool = False,
) -> LogProbs:
    """`response_logprobs` computed with each group's prompt run once (see the module docstring).

    Returns `LogProbs` with `logprobs`/`mask`/`entropy` `[N, L]` in the order of `samples`.
    `layout` (from `plan_shared_prompt(samples, device)`) lets several models share one plan. `with_hidden`: also
    the hidden states `[N, L, H]` predicting each token (`LogProbs.hidden`, as `response_logprobs`).
    """
    device = next(model.parameters()).device
    if layout is None:
        layout = plan_shared_prompt(samples, device)
    elif layout.input_ids.device != device or layout.targets.shape[0] != len(samples):
        raise ValueError("layout was planned for other samples or another device than the model's")
    n, length = layout.targets.shape
    keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    with _attention_implementation(model, ATTENTION_NAME), lm_head_input(model, with_hidden) as captured:
        if keep:
            logits = model(
                input_ids=layout.input_ids,
                position_ids=layout.position_ids,
                logits_to_keep=layout.predictor_index.flatten(),
                shared_prompt_layout=layout,
            ).logits.view(n, length, -1)  # [N, L, V]
        else:
            logits = model(
                input_ids=layout.input_ids, position_ids=layout.position_ids, shared_prompt_layout=layout
            ).logits[0, layout.predictor_index]
    hidden = None
    if with_hidden:
        h = captured["hidden"]
        hidden = h.view(n, length, -1) if keep else h[0, layout.predictor_index]  # [N, L, H]
    return masked_logprobs(logits, layout.targets, layout.mask, temperature, with_entropy, hidden)
