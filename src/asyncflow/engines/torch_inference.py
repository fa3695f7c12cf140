"""The built-in torch inference engine: continuous batching over a slot-wise static KV cache.

Owns: `TorchInferenceEngine` (registered as inference engine "torch"), its KV cache
`SlotKVCache`, and `sample_tokens` (temperature, top-k, top-p, greedy; sampling log-probs).

How a generation runs. Up to `max_batch_size` samples ("slots") are in flight. Slot r lives in
row r of per-layer key/value tensors `[rows, kv_heads, capacity, head_dim]`, holding its prompt
and fed response tokens at positions `0 .. length_r - 1`. The active slots are always rows
`0 .. n-1`, so one decode step runs the unmodified Hugging Face model on `input_ids [n, 1]` at
`position_ids [n, 1] = length`, writes each row's new key/value at its own position, and attends
over `[:n, :, :max(length) + 1]` under an additive `[n, 1, 1, L]` mask that hides each row's
positions beyond its own length (no mask at all when every row has the same length). A finished
sample is handed back at once; the survivors are compacted into the leading rows, and waiting
prompts, pulled lazily from the request iterator,
are prefilled together (right-padded, causal: a real token never sees the padding after it) into
the rows behind them; identical prompts (a group's samples) run once and their keys/values are copied into
each of their rows (the same numbers up to float rounding: a batched forward may round a row differently with
the batch's size). The cache plugs into the model only through `Cache.update`, so no modelling code is forked.

Invariants:
- `Completion.logprobs[i] = log softmax(logits / T)[response_ids[i]]` from the logits *before*
  top-k/top-p filtering: truncation only shapes which token is drawn, and the trainer's
  `response_logprobs(..., temperature=T)` recomputes exactly this number (no truncation there).
  Greedy decoding (T = 0) reports T = 1 log-probs.
- A sample stops at its first stop token (kept in `response_ids`, finish_reason "stop"), else
  after `max_new_tokens` tokens ("length").
- Weight updates in flight (`updates_in_flight = True`): `update_weights` may be called from any
  thread while a `generate` runs. The newest pending version is taken by the generating thread at its
  next step (before any prefill or decode), never in the middle of one: it loads the weights and
  recomputes the keys/values of every in-flight slot (prompt and the tokens sampled so far) under
  them, so a sample goes on from the tokens it has, continued by the new weights on its full prefix.
  Each token records the version that sampled it (`Completion.token_versions`);
  `Completion.weight_version` is the newest of them. With no generation open, the update is applied
  at once; one left pending when a generation ends is applied then.
- A request iterator may yield `None` ("nothing ready now"): the engine decodes what it has and asks
  again after the next step (after `IDLE_WAIT_S` when nothing is in flight). Each request may carry its
  own `SamplingParams`; samples with equal settings are drawn together.
- Token streaming (`streams_tokens = True`): a request's `on_tokens` is called on the generating thread
  right after each of its tokens is sampled (prefill and decode steps alike), before that token can finish
  the sample, so the token that ends it is delivered too and its `Completion` comes after every call; a
  recomputation after a weight update samples nothing, so nothing is delivered twice.
- LoRA adapter sync (`adapter=` settings, `train.lora.sync: adapter`): the engine loads the base weights once and
  wraps the same target modules with the same LoRA layers as the trainer (`asyncflow.engines.peft_lora`: frozen
  base, `y = base(x) + alpha/r * B(A(x))`); `update_weights` then takes the adapter's tensors only (peft's naming,
  `adapter_state_dict`) and copies them into the A/B matrices of one of `adapter_slots` adapters
  (`workflow.max_staleness` + 1). A request runs, to its end, with the adapter that was newest when it entered the
  batch: a batch mixes adapters row by row (`peft_lora.row_adapters`), an update recomputes nothing, and every token
  carries its request's version. A version's adapter is overwritten once it is neither the newest nor used by a
  request in flight; when every adapter is in use, the oldest version's requests move to the new one (recomputed
  as with full weights). The outputs equal those of the merged weights up to float rounding.
- Routing record (`record_routing=True`, an MoE model; `algo.router_replay`): each completion carries the experts
  every router chose at every position the engine ran (`Completion.routed_experts` `[P + R - 1, layers, k]`,
  `asyncflow.models.moe`): the prompt's from its prefill (a group's prompt runs once: one record), each fed
  response token's from its decode step; a recomputation after a weight update records the prefix again, so the
  record is the routing of the keys/values the later tokens saw.
- One `torch.Generator` seeded with `seed` drives all sampling: the same seed, requests (in the
  same order) and `max_batch_size` give identical completions.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers.cache_utils import Cache

from asyncflow.engines.base import (
    Completion,
    GenerationRequest,
    InferenceEngineBase,
    LoRASettings,
    SamplingParams,
    check_adapter_tensors,
    register_inference_engine,
)
from asyncflow.models.hf import causal_lm
from asyncflow.models.loading import load_model, resolve_model_path
from asyncflow.models.moe import routing_recorder


class SlotKVCache(Cache):
    """Keys/values of `rows` independent sequences, one row each, per layer `[rows, kv_heads, capacity, head_dim]`.

    Before every forward the engine says what the forward writes: `prefill_rows(start)` (the batch is
    fresh prompts going to rows `start ..`, positions `0 .. q-1`) or `decode_at(positions, kv_len)`
    (the batch is rows `0 .. n-1`, one token each, written at `positions [n]`). Tensors are
    allocated on the first forward, with the dtype and head sizes the model hands to `update`.
    """

    def __init__(self, rows: int):
        super().__init__(layers=[])
        self.rows = rows
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._start = 0
        self._rows: torch.Tensor | None = None  # prefill: the fresh row each written row copies (None: row i is i)
        self._positions: torch.Tensor | None = None
        self._index: torch.Tensor | None = None  # positions expanded to a key update's shape, shared by layers
        self._kv_len = 0

    def reserve(self, capacity: int) -> None:
        """Make room for positions `0 .. capacity-1` (grows in steps of 64, keeping the contents)."""
        if capacity <= self.capacity:
            return
        capacity = -(-capacity // 64) * 64
        for tensors in (self.keys, self.values):
            for i, old in enumerate(tensors):
                tensors[i] = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
                tensors[i][:, :, : self.capacity] = old
        self.capacity = capacity

    def prefill_rows(self, start: int, rows: torch.Tensor | None = None) -> None:
        """The next forward prefills fresh sequences into rows `start ..`; with `rows [m]`, row `start + i` gets the
        keys/values of the forward's row `rows[i]` (identical sequences run once)."""
        self._start, self._rows, self._positions = start, rows, None

    def decode_at(self, positions: torch.Tensor, kv_len: int) -> None:
        self._positions, self._kv_len, self._index = positions, kv_len, None

    @torch.inference_mode()  # the cache tensors are inference tensors: written in inference mode only
    def move_rows(self, src: list[int], dst: list[int], length: int) -> None:
        """Copy rows `src` to rows `dst` (positions `< length`): compaction after samples finish."""
        device = self.keys[0].device
        src_rows, dst_rows = torch.tensor(src, device=device), torch.tensor(dst, device=device)  # disjoint rows
        for tensor in (*self.keys, *self.values):
            window = tensor[:, :, :length]
            window.index_copy_(0, dst_rows, window.index_select(0, src_rows))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == len(self.keys):
            for tensors, states in ((self.keys, key_states), (self.values, value_states)):
                tensors.append(states.new_zeros(self.rows, states.shape[1], self.capacity, states.shape[3]))
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self._positions is None:  # fresh prompts have no past: they attend to their own keys only
            new_keys, new_values = key_states, value_states
            if self._rows is not None:
                new_keys, new_values = key_states[self._rows], value_states[self._rows]
            end, q = self._start + new_keys.shape[0], key_states.shape[2]
            keys[self._start : end, :, :q] = new_keys
            values[self._start : end, :, :q] = new_values
            return key_states, value_states
        # Decode: scatter_ writes rows 0..n-1 of the full tensors (the index covers only those rows) and one
        # as_strided makes each [n, heads, kv_len, dim] window. A small model's decode step on CPU costs
        # about its number of ops, so the cache adds as few per layer as it can.
        keys.scatter_(2, self._index_for(key_states.shape), key_states)
        values.scatter_(2, self._index_for(value_states.shape), value_states)

        def window(t: torch.Tensor) -> torch.Tensor:
            return t.as_strided((key_states.shape[0], t.shape[1], self._kv_len, t.shape[3]), t.stride())

        return window(keys), window(values)

    def _index_for(self, shape: torch.Size) -> torch.Tensor:
        """Write positions expanded to an update's shape `[n, heads, 1, dim]`; built once per step, shared by layers."""
        if self._index is None or self._index.shape != shape:
            if self._positions is None:
                raise RuntimeError("SlotKVCache: a decode forward without decode_at")
            self._index = self._positions.view(-1, 1, 1, 1).expand(shape)
        return self._index


MIN_TEMPERATURE = 1e-6
"""The smallest non-zero temperature: below it `logits / T` can overflow float32 to inf (and softmax to NaN)."""


def check_sampling_params(params: SamplingParams) -> None:
    if not (params.temperature == 0 or MIN_TEMPERATURE <= params.temperature < float("inf")):
        raise ValueError(f"temperature must be 0 (greedy) or a finite value >= {MIN_TEMPERATURE}, "
                         f"got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {params.top_k}")
    if params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")


def check_prompt(request: GenerationRequest, vocab_size: int) -> None:
    ids = request.prompt_ids
    if not ids:
        raise ValueError(f"request {request.request_id!r} has an empty prompt")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"request {request.request_id!r} has token ids outside [0, {vocab_size})")


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. logits `[n, V]` -> (tokens `[n]` long, log-probs `[n]` float32).

    The log-prob is under softmax(logits / T) before top-k/top-p truncation (T = 1 when greedy).
    """
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    logprobs = (logits / params.temperature).log_softmax(-1)
    allowed = logprobs
    if 0 < params.top_k < logprobs.shape[-1]:
        kth_best = logprobs.topk(params.top_k, dim=-1).values[:, -1:]
        allowed = allowed.masked_fill(allowed < kth_best, float("-inf"))
    if params.top_p < 1.0:
        sorted_logprobs, order = allowed.sort(dim=-1, descending=True)
        sorted_probs = sorted_logprobs.exp()
        sorted_drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        # The most likely token always stays, whatever rounding does: a top_p below float32's smallest step
        # (or a first mass that rounds above 0) would otherwise drop every token and softmax would give NaN.
        sorted_drop[:, 0] = False
        drop = sorted_drop.scatter(1, order, sorted_drop)
        allowed = allowed.masked_fill(drop, float("-inf"))
    tokens = torch.multinomial(allowed.softmax(-1), 1, generator=generator).squeeze(1)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


IDLE_WAIT_S = 0.001  # pause before asking an idle request source again


@dataclass
class _Adapter:
    """One of the engine's LoRA adapters under adapter sync: its peft name, A/B parameters and the version they hold."""

    name: str
    parameters: dict[str, torch.Tensor]
    version: int | None = None  # None: never loaded
    users: int = 0  # requests in flight running with it


@dataclass
class _Slot:
    request: GenerationRequest
    params: SamplingParams
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    routing: list[torch.Tensor] = field(default_factory=list)  # [positions, layers, k] pieces (routing record)
    adapter: _Adapter | None = None  # the adapter it runs with (adapter sync)

    @property
    def cached_length(self) -> int:
        """Tokens whose keys/values are in the cache: the prompt and all but the last sampled token."""
        return len(self.request.prompt_ids) + len(self.response_ids) - 1

    def append(self, token: int, logprob: float, version: int) -> None:
        self.response_ids.append(token)
        self.logprobs.append(logprob)
        self.token_versions.append(version)
        if token in self.params.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.response_ids) >= self.params.max_new_tokens:
            self.finish_reason = "length"


def load_tied_once(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """`model.load_state_dict(state_dict)`, strict but for a tied parameter that came once under another of its
    names (an FSDP2 run's weight channel sends a tied embedding once): loading it through one name loads the other."""
    result = model.load_state_dict(state_dict, strict=False)
    params = model.state_dict(keep_vars=True)
    loaded = {id(params[name]) for name in state_dict if name in params}
    missing = [name for name in result.missing_keys if id(params[name]) not in loaded]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"weights do not match the model: missing {missing[:3]}, "
                           f"unexpected {list(result.unexpected_keys)[:3]}")


class TorchInferenceEngine(InferenceEngineBase):
    """Continuous-batching sampler around a Hugging Face causal LM (full attention), CPU or one GPU."""

    generator: torch.Generator  # always one (seeded in __init__)
    updates_in_flight = True  # `update_weights` may be called while a `generate` runs (module docstring)
    streams_tokens = True  # requests' `on_tokens` callbacks are called as tokens are sampled

    @classmethod
    def from_pretrained(cls, model_path: str, *, dtype: str = "float32", **kwargs: Any) -> TorchInferenceEngine:
        """The engine over the model in `model_path` (a local HF folder or `preset:NAME`), loaded for inference."""
        model = load_model(resolve_model_path(str(model_path)), dtype=dtype).eval().requires_grad_(False)
        return cls(model, **kwargs)

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_batch_size: int = 64,
        device: str | torch.device = "cpu",
        seed: int = 0,
        weight_version: int = 0,
        adapter: LoRASettings | None = None,
        adapter_slots: int = 2,
        record_routing: bool = False,
    ) -> None:
        """`adapter`: LoRA adapter sync with `adapter_slots` adapters (module docstring); `model` is then the base
        model, wrapped in place. `record_routing`: the routing record (module docstring)."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if adapter_slots < 1:
            raise ValueError(f"adapter_slots must be >= 1, got {adapter_slots}")
        config = causal_lm(model).config
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError("TorchInferenceEngine supports decoder-only causal LMs, not encoder-decoder models")
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise ValueError(
                "TorchInferenceEngine supports full-attention models only; this model has layer types "
                f"{sorted(layer_types)}"
            )
        self.device = torch.device(device)
        self.adapter = adapter
        self._adapters: list[_Adapter] = []  # adapter sync: the pool, the newest first
        self._row_names: list[str] | None = None  # the adapter of each row of the running forward (adapter sync)
        if adapter is not None:
            from asyncflow.engines.peft_lora import adapter_pool, add_adapters, row_adapters  # peft only when asked

            pool = adapter_pool(add_adapters(model, adapter), adapter, adapter_slots)
            self._adapters = [_Adapter(name, parameters) for name, parameters in pool]
            self._adapters[0].version = weight_version  # a fresh adapter (B = 0): the base weights
            row_adapters(model, lambda: self._row_names)
            model.requires_grad_(False)
        self.model = model.to(self.device).eval()
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self.vocab_size = cast(torch.nn.Embedding, causal_lm(model).get_input_embeddings()).num_embeddings
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._open_generations = 0
        self._lock = threading.Lock()  # guards `_open_generations` and `_pending`
        self._pending: tuple[Mapping[str, torch.Tensor], int] | None = None  # newest update not applied yet
        self._per_row_logits = True  # `logits_to_keep` as [m, 1] positions (recent transformers); see _prefill
        self._recorder = routing_recorder(model) if record_routing else None
        self._routed: torch.Tensor | None = None  # the last forward's routing [rows, q, layers, k], when recording

    # ---------------------------------------------------------------- public API
    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load `state_dict` into the model in place (strict; under adapter sync the adapter's tensors, every one
        of them); tokens sampled afterwards carry `version`.
        Thread-safe. While a `generate` runs it only hands the weights over: the generating thread applies
        them at its next step (a newer call replaces a pending one); otherwise they are loaded at once."""
        if self._adapters:  # checked here, not on the generating thread that may load them
            from asyncflow.engines.peft_lora import match_adapter

            check_adapter_tensors(state_dict)
            match_adapter(self._adapters[0].parameters, state_dict)
        with self._lock:
            if self._open_generations:
                self._pending = (state_dict, version)
                return
            self._load(state_dict, version)

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """Under adapter sync, the newest version's adapter as `update_weights` took it (peft's naming; the tensors
        themselves, not copies)."""
        if not self._adapters:
            raise ValueError("adapter_weights: this engine does not run under train.lora.sync=adapter")
        return dict(self._adapters[0].parameters)

    def _load(self, state_dict: Mapping[str, torch.Tensor], version: int) -> bool:
        """Load a version; -> whether requests in flight run on other weights now (their keys/values are stale)."""
        self.weight_version = version
        if not self._adapters:
            load_tied_once(self.model, state_dict)
            return True
        from asyncflow.engines.peft_lora import copy_adapter

        # A free adapter (not the newest, no request on it), else the oldest version's, whose requests move along.
        newest, older = self._adapters[0], self._adapters[1:]
        free = [a for a in older if not a.users]
        target = free[0] if free else min(older, key=lambda a: cast(int, a.version), default=newest)
        copy_adapter(target.parameters, state_dict)
        target.version = version
        self._adapters.remove(target)
        self._adapters.insert(0, target)
        return target.users > 0

    def _take_pending(self) -> bool:
        """Apply a pending update (generating thread only); True if requests in flight must be recomputed."""
        with self._lock:
            pending, self._pending = self._pending, None
            return pending is not None and self._load(*pending)

    def generate(self, requests: Iterable[GenerationRequest | None], params: SamplingParams) -> Iterator[Completion]:
        """Yield a `Completion` per request as each finishes (completion order), pulling `requests` lazily."""
        check_sampling_params(params)
        return self._generate(iter(requests), params)

    # ---------------------------------------------------------------- the loop
    def _generate(self, requests: Iterator[GenerationRequest | None], params: SamplingParams) -> Iterator[Completion]:
        with self._lock:
            self._open_generations += 1
        slots: list[_Slot] = []
        try:
            cache: SlotKVCache | None = None
            exhausted = False
            while True:
                if self._take_pending() and slots:
                    assert cache is not None  # slots live in the cache
                    self._recompute(cache, slots)
                free = self.max_batch_size - len(slots)
                if not exhausted and free:
                    new, exhausted = self._pull(requests, free, params)
                    if new:
                        if cache is None:  # a source that ran dry on the first pull never refills
                            cache = SlotKVCache(rows=len(new) if exhausted else self.max_batch_size)
                        self._prefill(cache, len(slots), new)
                        slots += new
                    # a prefill may already finish samples (max_new_tokens=1, or a stop token first)
                    yield from self._retire(slots, cache)
                if not slots:
                    if exhausted:
                        return
                    time.sleep(IDLE_WAIT_S)
                    continue
                assert cache is not None  # slots live in the cache
                self._decode(cache, slots)
                yield from self._retire(slots, cache)
        finally:
            with self._lock:
                for s in slots:  # a generation closed early
                    if s.adapter is not None:
                        s.adapter.users -= 1
                self._open_generations -= 1
                if not self._open_generations and self._pending is not None:
                    self._load(*self._pending)
                    self._pending = None

    def _pull(
        self, requests: Iterator[GenerationRequest | None], wanted: int, params: SamplingParams
    ) -> tuple[list[_Slot], bool]:
        """Up to `wanted` new slots, stopping early at a `None` (nothing ready now); also whether the source ended."""
        new: list[_Slot] = []
        while len(new) < wanted:
            try:
                request = next(requests)
            except StopIteration:
                return new, True
            if request is None:
                break
            new.append(self._checked(request, params))
        return new, False

    def _checked(self, request: GenerationRequest, params: SamplingParams) -> _Slot:
        check_prompt(request, self.vocab_size)
        if request.params is not None:
            check_sampling_params(request.params)
        slot = _Slot(request, request.params or params)
        if self._adapters:
            with self._lock:
                slot.adapter = self._adapters[0]
                slot.adapter.users += 1
        return slot

    def _retire(self, slots: list[_Slot], cache: SlotKVCache | None) -> Iterator[Completion]:
        """Hand back finished slots and move the last running slots into their rows (rows stay 0..n-1)."""
        finished = [(s, s.finish_reason) for s in slots if s.finish_reason]
        if not finished:
            return
        keep = len(slots) - len(finished)
        holes = [i for i in range(keep) if slots[i].finish_reason]
        movers = [i for i in range(keep, len(slots)) if not slots[i].finish_reason]
        if holes:
            assert cache is not None  # slots live in the cache
            cache.move_rows(movers, holes, max(slots[i].cached_length for i in movers))
        for hole, mover in zip(holes, movers):
            slots[hole] = slots[mover]
        del slots[keep:]
        for s, reason in finished:
            if s.adapter is not None:
                with self._lock:
                    s.adapter.users -= 1
            r = s.request
            versions = s.token_versions
            yield Completion(
                r.request_id, r.prompt_ids, s.response_ids, s.logprobs, reason, versions[-1],
                token_versions=versions if versions[0] != versions[-1] else None,
                routed_experts=torch.cat(s.routing) if s.routing else None,
            )

    # Grad mode is set per forward, never around the generator: a `with` spanning a `yield` would
    # leak inference mode into the consumer's code (e.g. a trainer working between completions).
    @torch.inference_mode()
    def _prefill(self, cache: SlotKVCache, start: int, new: list[_Slot]) -> None:
        """Run fresh prompts into cache rows `start ..`; sample their first token."""
        prompts = [s.request.prompt_ids for s in new]
        cache.reserve(max(map(len, prompts)) + max(s.params.max_new_tokens for s in new))
        last = torch.tensor([len(ids) - 1 for ids in prompts], device=self.device)[:, None]  # [m, 1]
        logits = self._forward_rows(cache, start, prompts, last, new) if self._per_row_logits else None
        if logits is not None and logits.ndim == 3 and logits.shape[:2] == (len(new), 1):
            logits = logits[:, -1]
        else:
            # transformers releases without per-row `logits_to_keep` positions: project every prompt position
            # (the prefill is re-run; it writes the same keys/values to the same cache rows).
            self._per_row_logits = False
            rows = torch.arange(len(new), device=self.device)
            logits = self._forward_rows(cache, start, prompts, 0, new)[rows, last[:, 0]]
        if self._routed is not None:
            for s, routed, ids in zip(new, self._routed, prompts):
                s.routing = [routed[: len(ids)]]
        self._append(new, logits)

    @torch.inference_mode()
    def _recompute(self, cache: SlotKVCache, slots: list[_Slot]) -> None:
        """Rewrite the keys/values of the in-flight slots (rows 0..n-1: prompt and every sampled token but the
        last, which the next decode step feeds) under the current weights. Nothing is sampled."""
        sequences = [s.request.prompt_ids + s.response_ids[:-1] for s in slots]
        self._forward_rows(cache, 0, sequences, 1, slots)
        if self._routed is not None:
            for s, routed, ids in zip(slots, self._routed, sequences):
                s.routing = [routed[: len(ids)]]

    def _forward_rows(
        self, cache: SlotKVCache, start: int, sequences: list[list[int]], logits_to_keep: int | torch.Tensor,
        slots: list[_Slot],
    ) -> torch.Tensor:
        """Run `sequences` (those of `slots`; right-padded to q, causal: a real token never sees the padding after it)
        into cache rows `start ..` from position 0; -> the logits `logits_to_keep` (an int, or per-row positions
        `[m, 1]`) selects, one row per sequence. Identical sequences on the same adapter (the samples of a group share
        their prompt) run once and their keys/values are copied."""
        names = [s.adapter.name if s.adapter is not None else "" for s in slots]
        first: dict[tuple[str, tuple[int, ...]], int] = {}
        inverse = [first.setdefault((name, tuple(ids)), row) for row, (name, ids) in enumerate(zip(names, sequences))]
        unique = list(first.values())  # the row of each distinct sequence's first occurrence
        rows = None
        if len(unique) < len(sequences):
            position = {row: i for i, row in enumerate(unique)}
            rows = torch.tensor([position[row] for row in inverse], device=self.device)
            sequences = [sequences[row] for row in unique]
            if isinstance(logits_to_keep, torch.Tensor):
                logits_to_keep = logits_to_keep[unique]
        q = max(map(len, sequences))
        input_ids = torch.zeros(len(sequences), q, dtype=torch.long)
        for row, ids in enumerate(sequences):
            input_ids[row, : len(ids)] = torch.tensor(ids)
        cache.prefill_rows(start, rows)
        causal = torch.ones(q, q, dtype=torch.bool, device=self.device).tril()
        with self._recording() as routed, self._rows_on([slots[row] for row in unique]):
            logits: torch.Tensor = self.model(
                input_ids=input_ids.to(self.device),
                position_ids=torch.arange(q, device=self.device)[None],
                attention_mask=self._additive(causal[None, None]),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=logits_to_keep,
            ).logits
        if self._recorder is not None:
            by_row = routed[0].unflatten(0, (len(sequences), q))
            self._routed = by_row if rows is None else by_row[rows]
        return logits if rows is None else logits[rows]

    @contextmanager
    def _rows_on(self, slots: list[_Slot]) -> Iterator[None]:
        """Under adapter sync, the forward inside runs row i with the adapter of `slots[i]`; outside it, peft's own."""
        self._row_names = [cast(_Adapter, s.adapter).name for s in slots] if self._adapters else None
        try:
            yield
        finally:
            self._row_names = None

    def _recording(self) -> AbstractContextManager[list[torch.Tensor]]:
        """The routing capture of one forward (an empty list and nothing hooked when not recording)."""
        return self._recorder.capture() if self._recorder is not None else nullcontext([])

    @torch.inference_mode()
    def _decode(self, cache: SlotKVCache, slots: list[_Slot]) -> None:
        """One token for every running slot (rows 0..n-1), each at its own position."""
        lengths = [s.cached_length for s in slots]
        kv_len = max(lengths) + 1
        positions = torch.tensor(lengths, device=self.device)
        if min(lengths) == kv_len - 1:
            # Every row sees the whole window: no mask at all, so SDPA takes its fused path (an explicit mask
            # forces the slower masked kernel). With one query token there is nothing causal to hide either.
            mask = None
        else:
            visible = torch.arange(kv_len, device=self.device)[None, :] <= positions[:, None]  # [n, kv_len]
            mask = self._additive(visible[:, None, None, :])
        cache.decode_at(positions, kv_len)
        with self._recording() as routed, self._rows_on(slots):
            logits = self.model(
                input_ids=torch.tensor([[s.response_ids[-1]] for s in slots], device=self.device),
                position_ids=positions[:, None],
                attention_mask=mask,
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
        if routed:
            for s, row in zip(slots, routed[0].split(1)):
                s.routing.append(row)
        self._append(slots, logits)

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        """bool mask -> additive float mask in the model's dtype (SDPA would otherwise convert it per layer)."""
        dtype = causal_lm(self.model).dtype
        return torch.zeros(visible.shape, dtype=dtype, device=self.device).masked_fill_(
            ~visible, torch.finfo(dtype).min
        )

    def _append(self, slots: list[_Slot], logits: torch.Tensor) -> None:
        """Sample every slot's next token; slots with equal settings in one draw (one draw when all share them)."""
        rows_by_params: dict[SamplingParams, list[int]] = {}
        for row, s in enumerate(slots):
            rows_by_params.setdefault(s.params, []).append(row)
        for params, rows in rows_by_params.items():
            picked = logits if len(rows) == len(slots) else logits[rows]
            tokens, logprobs = sample_tokens(picked, params, self.generator)
            for row, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist()):
                slot = slots[row]
                version = self.weight_version if slot.adapter is None else cast(int, slot.adapter.version)
                slot.append(token, logprob, version)
                if slot.request.on_tokens is not None:
                    slot.request.on_tokens([token], [logprob])


@register_inference_engine("torch")
def make_torch_inference_engine(
    *, model: torch.nn.Module | None = None, model_path: str | None = None, dtype: str = "float32", **kwargs: Any
) -> TorchInferenceEngine:
    """Registry factory: `model=` (a loaded causal LM) or `model_path=` (a local HF folder or `preset:NAME`)."""
    exactly_one = ValueError("the torch inference engine needs exactly one of model= or model_path=")
    if model is None:
        if model_path is None:
            raise exactly_one
        return TorchInferenceEngine.from_pretrained(model_path, dtype=dtype, **kwargs)
    if model_path is not None:
        raise exactly_one
    return TorchInferenceEngine(model, **kwargs)
