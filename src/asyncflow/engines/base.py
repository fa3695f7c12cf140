"""Engine interfaces: what the workers need from an inference engine and a training engine.

Owns: the `InferenceEngine` and `TrainEngine` protocols, the value types that cross them
(`SamplingParams`, `GenerationRequest`, `Completion`, `LoRASettings`), `Transcript` (completions and the tokens appended
between them, as a multi-turn row is trained), and the engine registry through which
adapters (the built-in torch engines, vLLM, an OpenAI-compatible server ...) plug in.

Invariants:
- The core never imports a particular engine; it asks the registry by name.
- Every `Completion` carries the weight version of the engine that generated it.
- `InferenceEngine.generate` yields each completion as soon as it finishes (completion order,
  not request order), so downstream stages can start on the first finished group.
- An engine with a true `streams_tokens` attribute calls a request's `on_tokens` with its tokens as they are
  sampled: every response token exactly once, in order, all before its `Completion` is yielded.
- Optional abilities are declared in the protocols, with their defaults in one place (`InferenceEngineBase`,
  `TrainEngineBase`); callers read them as attributes, never probe for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from asyncflow.models.logprobs import TrainSample
from asyncflow.models.tri_model import TriLogProbs
from asyncflow.weights.buckets import BucketStream

LossFn = Callable[[TriLogProbs], tuple[torch.Tensor, dict[str, float]]]
TokenCallback = Callable[[list[int], list[float]], None]
"""`on_tokens(token_ids, logprobs)`: a request's newly sampled tokens and their sampling log-probs."""


class RowLoss(Protocol):
    """A micro-batch's loss as a picklable object: called like a `LossFn` on the tri-model log-probs of its
    rows, and `select(rows)` gives the loss of a subset of the rows (in that order), for an engine that
    splits a micro-batch over processes. The loss must be a sum over rows (normalised by the caller)."""

    def __call__(self, out: TriLogProbs) -> tuple[torch.Tensor, dict[str, float]]: ...

    def select(self, rows: Sequence[int]) -> RowLoss: ...

@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `top_k=0` and `top_p=1.0` disable those filters."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class LoRASettings:
    """A LoRA adapter's shape (`train.lora`): the training engine trains one; a rollout engine under adapter sync
    applies one per weight version. Plain values (no peft import), so it travels to any process."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Module names (last component), or `all-linear`."""

    def adapter_config(self, base_model_name_or_path: str | None = None) -> dict[str, Any]:
        """The adapter's `adapter_config.json` in peft's format (what peft and vLLM read next to the tensors)."""
        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
            "lora_dropout": self.dropout, "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "base_model_name_or_path": base_model_name_or_path,
        }  # fmt: skip


def check_adapter_tensors(names: Iterable[str]) -> None:
    """ValueError naming `train.lora.sync` unless every name is a LoRA adapter tensor's (`...lora_A.weight`): what
    an engine under adapter sync takes per version."""
    full = [name for name in names if ".lora_" not in name]
    if full:
        raise ValueError(f"train.lora.sync=adapter: the engine takes the LoRA adapter's tensors per version, got "
                         f"other tensors ({full[:3]}); publish the adapter alone, or set train.lora.sync=merged")


@dataclass
class GenerationRequest:
    request_id: Any
    prompt_ids: list[int]
    params: SamplingParams | None = None
    """This request's sampling settings, overriding those passed to `generate` (a server's per-call
    settings, a multi-turn episode's remaining token budget)."""
    on_tokens: TokenCallback | None = None
    """Incremental output, honoured by engines with a true `streams_tokens` attribute (ignored by others): called
    on the engine's own thread with each step's new tokens of this request (a stop token that ends it included),
    so the calls concatenate to `Completion.response_ids` / `logprobs`; none after the `Completion` is yielded,
    none twice (a weight update in flight recomputes the cache, it samples nothing again). It must be cheap and
    must neither block nor raise: it runs inside the loop every request shares."""


@dataclass
class Completion:
    """One finished sample. `logprobs[i]` is the sampling log-prob of `response_ids[i]`
    (under the temperature-scaled distribution, before top-k/top-p truncation)."""

    request_id: Any
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token was produced, and is included) or "length"
    weight_version: int  # the version that sampled the last token (the newest one in `token_versions`)
    token_versions: list[int] | None = None
    """Per response token, the weight version that sampled it (partial rollouts span versions);
    `None` = every token was sampled by `weight_version`."""
    loss_mask: list[int] | None = None
    """Per response token, 1 if the model sampled it (trained), 0 if it was appended from outside
    (tool output, chat-template tokens in a multi-turn episode; its `logprobs` entry is 0);
    `None` = every token was sampled."""
    cached_prompt_tokens: int | None = None
    """Prompt tokens whose keys and values the engine took from its prefix cache instead of computing them;
    `None` = the engine does not report it."""
    routed_experts: torch.Tensor | None = None
    """The experts each MoE router chose at each position the engine ran, `[P + R - 1, layers, k]` in a compact
    integer dtype (`asyncflow.models.moe`), from an engine asked to record them (`algo.router_replay`); else None."""


@dataclass
class Transcript:
    """A multi-turn row's tokens as they are trained: after `prompt_ids`, each sampled piece (loss mask 1, its
    sampling log-probs) and each piece appended between them (tool output, template tokens; mask 0, log-prob 0).
    `response_ids`, `logprobs`, `loss_mask` and `token_versions` stay aligned, token by token."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)

    def add_sampled(self, ids: Sequence[int], logprobs: Sequence[float], version: int) -> None:
        self.response_ids += ids
        self.logprobs += logprobs
        self.loss_mask += [1] * len(ids)
        self.token_versions += [version] * len(ids)

    def add_appended(self, ids: Sequence[int], version: int) -> None:
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.token_versions += [version] * len(ids)

    def count_retokenize_drift(self, sampled: Sequence[Sequence[int]]) -> int:
        """How many trained ids (loss mask 1, in order) differ from the ids the engine sampled (`sampled`: each
        generation's ids as the engine returned them, in order), the difference in count included. Multi-turn rows
        and `serve` episodes keep the sampled ids, never text turned back into ids, so this is 0
        (`rollout/retokenize_drift_tokens` counts it per step)."""
        trained = [token for token, mask in zip(self.response_ids, self.loss_mask) if mask]
        generated = [token for piece in sampled for token in piece]
        return sum(a != b for a, b in zip(trained, generated)) + abs(len(trained) - len(generated))

@runtime_checkable
class InferenceEngine(Protocol):
    """`weight_version`: the version tokens are sampled with now. Abilities (defaults in `InferenceEngineBase`):
    `updates_in_flight` (see `update_weights`), `streams_tokens` (see `GenerationRequest.on_tokens`), `generator`
    (the `torch.Generator` sampling draws from, whose state checkpoints keep; None: sampling is not resumable
    bit for bit), `close()` (free the engine's processes and memory)."""

    weight_version: int
    updates_in_flight: bool
    streams_tokens: bool

    @property
    def generator(self) -> torch.Generator | None:
        """Read-only: an engine may narrow it (one that always samples from its own generator)."""
        ...

    def generate(self, requests: Iterable[GenerationRequest | None], params: SamplingParams) -> Iterator[Completion]:
        """Generate for every request, yielding completions as they finish.

        `requests` may be a lazy iterator: the engine pulls new requests as batch slots free up.
        It may yield `None`, meaning "no request is ready now": the engine goes on with the samples
        it has in flight and asks again later, so a request source that waits on something else
        (a tool call, an HTTP client) never stalls the batch.
        """
        ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new policy weights; subsequent generations are tagged with `version`.

        An engine with a true `updates_in_flight` attribute (partial rollouts) also takes this call from
        another thread while a `generate` runs: it applies the weights at its next decode step, the samples
        in flight going on under them from the tokens they have (their KV recomputed), and reports which
        version sampled each token (`Completion.token_versions`). Without it, callers change weights only
        between `generate` calls."""
        ...

    def close(self) -> None: ...


class InferenceEngineBase:
    """The defaults of `InferenceEngine`'s abilities: an adapter subclasses this and sets what it can do."""

    weight_version: int = 0
    updates_in_flight: bool = False
    streams_tokens: bool = False
    generator: torch.Generator | None = None

    def close(self) -> None:
        """Nothing to free by default."""


@runtime_checkable
class TrainEngine(Protocol):
    """Policy training, as the trainer worker drives it: gradients accumulate over micro-batches until
    one `optimizer_step`; the loss is the caller's (`loss_fn` maps the tri-model log-probs of a micro-batch
    to a loss and float stats; an engine running on several processes needs a `RowLoss`). The trainer
    builds its engine from the registry by `train.engine` (`make_train_engine`)."""

    @property
    def device(self) -> torch.device:
        """Where the policy's parameters live (read-only: engines compute it from their model)."""
        ...

    def backward_micro_batch(
        self, samples: list[TrainSample], loss_fn: LossFn | RowLoss, *, temperature: float = 1.0
    ) -> dict[str, float]:
        """Forward one micro-batch (policy with grad; reference and old policy without), call `loss_fn`,
        backpropagate; returns its stats plus `loss` (NaN when not finite: no gradient then)."""
        ...

    def optimizer_step(self, grad_scale: float = 1.0) -> dict[str, float]:
        """Scale accumulated gradients by `grad_scale`, clip, step optimizer and LR schedule, zero them;
        returns `grad_norm`, `lr` and `skipped` (1.0 when a non-finite loss or gradient skipped the step)."""
        ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The policy weights (detached; for weight sync and checkpoints)."""
        ...

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None: ...

    def training_state(self) -> dict[str, Any]:
        """Optimizer and schedule state for checkpoints."""
        ...

    def load_training_state(self, state: dict[str, Any]) -> None: ...

    def load_checkpoint(self, weights: Mapping[str, torch.Tensor], training_state: dict[str, Any]) -> None:
        """Restore a checkpoint written from `state_dict()` and `training_state()` (resume)."""
        ...

    def close(self) -> None:
        """Stop what the engine started (a multi-rank engine's ranks)."""
        ...

    def policy_module(self) -> torch.nn.Module | None:
        """The live policy as a module of this process (evaluation generates with it, without a copy of the
        weights), or None when the weights live elsewhere (a multi-rank engine's ranks)."""
        ...

    def metrics(self) -> dict[str, float]:
        """Gauges of the engine for the step's metrics row (e.g. its ranks' peak memory); {} by default."""
        ...

    def weight_stream(self, distinct: bool = False, dtype: torch.dtype | None = None
                      ) -> Mapping[str, torch.Tensor] | BucketStream:
        """The policy weights for a weight publisher, which copies them in bucket by bucket: `state_dict()` by
        default; a multi-rank engine streams them from its ranks (`asyncflow.weights.BucketStream`). `distinct`: a
        tensor under several names (a tied embedding and output head) may come once, under its first name (what a
        weight channel sends: a receiving engine ties it again); a checkpoint takes every name. `dtype`: the receiving
        engine's; a stream may carry floating tensors wider than it in it (a publisher casts to it anyway)."""
        ...


class TrainEngineBase:
    """The defaults of `TrainEngine`'s optional parts."""

    def close(self) -> None:
        """Nothing to stop by default."""

    def policy_module(self) -> torch.nn.Module | None:
        """No module in this process by default."""
        return None

    def metrics(self) -> dict[str, float]:
        """No gauges by default."""
        return {}

    def weight_stream(self, distinct: bool = False, dtype: torch.dtype | None = None
                      ) -> Mapping[str, torch.Tensor] | BucketStream:
        """The whole `state_dict` by default (every name and dtype, whatever `distinct` and `dtype`)."""
        state_dict: Mapping[str, torch.Tensor] = self.state_dict()  # type: ignore[attr-defined]
        return state_dict


@runtime_checkable
class ShardedCheckpointing(Protocol):
    """A training engine whose weights and optimizer state live sharded over ranks: a checkpoint holds them
    as written by every rank (`training_state` then holds only what is not sharded)."""

    def save_sharded(self, folder: Path) -> None: ...

    def load_sharded(self, folder: Path) -> None: ...


INFERENCE_ENGINES: dict[str, Callable[..., InferenceEngine]] = {}
TRAIN_ENGINES: dict[str, Callable[..., TrainEngine]] = {}
_InferenceFactory = TypeVar("_InferenceFactory", bound=Callable[..., InferenceEngine])
_TrainFactory = TypeVar("_TrainFactory", bound=Callable[..., TrainEngine])
_Engine = TypeVar("_Engine")


def register_inference_engine(name: str) -> Callable[[_InferenceFactory], _InferenceFactory]:
    def decorator(factory: _InferenceFactory) -> _InferenceFactory:
        INFERENCE_ENGINES[name] = factory
        return factory

    return decorator


TRAIN_ENGINES_LOADING_THEIR_POLICY: set[str] = set()
"""Train engines whose ranks load the policy from its folder themselves: their caller loads no copy of it."""


def register_train_engine(name: str, *, loads_policy: bool = False) -> Callable[[_TrainFactory], _TrainFactory]:
    """Register a train engine factory under `name`; `loads_policy`: it is given the model folder (`model_path`)
    and loads the weights where it trains them, instead of a loaded `model`."""

    def decorator(factory: _TrainFactory) -> _TrainFactory:
        TRAIN_ENGINES[name] = factory
        if loads_policy:
            TRAIN_ENGINES_LOADING_THEIR_POLICY.add(name)
        return factory

    return decorator


def train_engine_loads_policy(name: str) -> bool:
    """Whether the train engine `name` loads the policy itself (`register_train_engine(..., loads_policy=True)`)."""
    return name in TRAIN_ENGINES_LOADING_THEIR_POLICY


def _make(
    registry: dict[str, Callable[..., _Engine]], kind: str, protocol: type, base: type, name: str,
    kwargs: dict[str, Any],
) -> _Engine:
    factory: Callable[..., _Engine]
    if name in registry:
        factory = registry[name]
    elif ":" in name:  # a user adapter given as "package.module:factory"
        import importlib

        module_name, _, attr = name.partition(":")
        factory = getattr(importlib.import_module(module_name), attr)
    else:
        raise ValueError(f"unknown {kind} engine {name!r}; registered: {sorted(registry)} (or give 'module:factory')")
    engine = factory(**kwargs)
    if not isinstance(engine, protocol):
        members = set(protocol.__annotations__) | {
            n for n, v in vars(protocol).items() if (callable(v) or isinstance(v, property)) and not n.startswith("_")
        }
        missing = [m for m in members if not hasattr(engine, m)]
        raise TypeError(f"engine {name!r} ({type(engine).__name__}) lacks {', '.join(sorted(missing))} of "
                        f"{protocol.__name__}: subclass asyncflow.engines.base.{base.__name__} for the defaults")
    return engine


def make_inference_engine(name: str, **kwargs: Any) -> InferenceEngine:
    return _make(INFERENCE_ENGINES, "inference", InferenceEngine, InferenceEngineBase, name, kwargs)


def make_train_engine(name: str, **kwargs: Any) -> TrainEngine:
    return _make(TRAIN_ENGINES, "train", TrainEngine, TrainEngineBase, name, kwargs)
