"""What every runtime provides, and what a rollout replica is built from.

Owns: `RolloutSpec` (the typed, picklable description of a rollout replica: model, engine and its device
settings, sampling, multi-turn or agent settings), `build_rollout_worker` (a replica's engine and worker,
built where the runtime places it), `build_generating_worker` (one that also samples given prompts, for
evaluation), and the `Runtime` protocol both runtimes implement: where the rollout replicas run, and where a
multi-rank trainer's ranks run (`Runtime.rank_launcher`).

Invariants:
- A rollout engine is built only inside the runtime that places it: by `InlineRuntime` in this process, by
  each Ray rollout actor in its own. Nothing else builds one for rollouts.
- A runtime changes no run state: it receives a spec, a queue and a weight receiver, and reports rows,
  sampler states, reward failures and errors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from asyncflow.engines.base import InferenceEngine, LoRASettings, SamplingParams, make_inference_engine
from asyncflow.models.loading import load_tokenizer
from asyncflow.observe import Timeline
from asyncflow.runtime.cores import CoreLending
from asyncflow.weights import TransportKind
from asyncflow.weights.deadlines import PHASES, WeightDeadlines
from asyncflow.workers.multiturn import MultiTurnSpec, make_rollout_worker
from asyncflow.workers.reward import RewardWorker
from asyncflow.workers.rollout import GeneratingRole, RolloutRole

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, kw_only=True)
class RolloutSpec:
    """A rollout replica, as plain values (it travels to Ray actors)."""

    model_path: str
    """A local Hugging Face folder (a preset already resolved to its folder)."""
    dtype: str
    device: str
    engine: str
    """Inference engine from the registry (or `package.module:factory`)."""
    engine_options: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the engine's factory (vLLM's memory fraction, KV cache size ...)."""
    max_batch_size: int
    params: SamplingParams
    group_size: int
    seed: int
    threads: int = 1
    """torch CPU threads of a replica in a process of its own."""
    on_weight_update: str = "finish"
    multiturn: MultiTurnSpec | None = None
    """Multi-turn episodes instead of single completions."""
    agent: dict | None = None
    """With `agent.fn`: the `AgentRolloutWorker` options."""
    make_scorer: Callable[[], RewardWorker] | None = None
    """Builds a reward worker in the replica's process (Ray replicas score their own rows)."""
    adapter: LoRASettings | None = None
    """LoRA adapter sync (`train.lora.sync: adapter`): the engine loads the base weights once and takes the
    adapter's tensors per version (`adapter=` of the torch and vLLM engines)."""
    adapter_slots: int = 2
    """Adapters an engine (torch, vLLM) runs in one batch under adapter sync: `workflow.max_staleness` + 1."""
    record_routing: bool = False
    """Router replay (`algo.router_replay`): the engine records its experts per position, rows carry them."""

    @property
    def scores_rows(self) -> bool:
        """The worker writes each row's reward itself (an environment or an agent's scorer scores it)."""
        return self.multiturn is not None or self.agent is not None

    @property
    def trains_own_prompt(self) -> bool:
        """Rows carry the prompt that is trained (`TRAINED_PROMPT_COLUMN`: an agent's first call)."""
        return self.agent is not None


def build_rollout_worker(spec: RolloutSpec, scorer: RewardWorker | None) -> RolloutRole:
    """The replica's inference engine and rollout worker (single-turn, multi-turn or agent)."""
    if spec.agent is None:
        return build_generating_worker(spec)
    from asyncflow.workers.agent import AgentRolloutWorker

    return AgentRolloutWorker(_engine(spec), spec.params, spec.group_size, tokenizer=load_tokenizer(spec.model_path),
                              scorer=scorer, **spec.agent)


def build_generating_worker(spec: RolloutSpec, *, policy: torch.nn.Module | None = None) -> GeneratingRole:
    """A single-turn or multi-turn worker of `spec` (which has no `agent`). With `policy` (a live module), its
    engine generates with that module itself: no copy of its weights, always current (held-out evaluation
    borrows the trainer's policy so)."""
    if spec.agent is not None:
        raise ValueError("an agent's worker runs episodes from the queue only: build it with build_rollout_worker")
    tokenizer = load_tokenizer(spec.model_path) if spec.scores_rows else None
    return make_rollout_worker(_engine(spec, policy), spec.params, spec.group_size, multiturn=spec.multiturn,
                               tokenizer=tokenizer)


def _engine(spec: RolloutSpec, policy: torch.nn.Module | None = None) -> InferenceEngine:
    if policy is not None:
        from asyncflow.engines.torch_inference import TorchInferenceEngine

        return TorchInferenceEngine(policy, max_batch_size=spec.max_batch_size, device=spec.device, seed=spec.seed)
    options = dict(spec.engine_options)
    if spec.adapter is not None:  # LoRA adapter sync: the base weights once, the adapter per version
        options["adapter"] = spec.adapter
        options.setdefault("adapter_slots", spec.adapter_slots)
    if spec.record_routing:
        options["record_routing"] = True
    return make_inference_engine(
        spec.engine, model_path=spec.model_path, dtype=spec.dtype, device=spec.device,
        max_batch_size=spec.max_batch_size, seed=spec.seed, **options,
    )


def weight_deadlines(config) -> WeightDeadlines:
    """Each phase's deadline on the weight path (`weights.*_timeout_s`, default `runtime.call_timeout_s`) and what a
    missed `apply` does (`weights.on_apply_deadline`)."""
    return WeightDeadlines(**{p: config.weights.deadline(p, config.runtime.call_timeout_s) for p in PHASES},
                           restart_on_apply=config.weights.on_apply_deadline == "restart")


class Runtime(Protocol):
    """Places the rollout replicas (and, with `stream` / `async`, runs their loops) for a workflow."""

    # read-only members (properties): a runtime may narrow them (an inline runtime's `local_rollout` is never None)
    @property
    def scores_in_rollout(self) -> bool:
        """Replicas write each row's reward with its response (no separate reward task)."""
        ...

    @property
    def weight_sync(self) -> TransportKind:
        """The weight transport (`asyncflow.weights.make_weight_sync`) replicas receive versions through."""
        ...

    @property
    def weight_sync_options(self) -> dict:
        """The transport's keyword arguments."""
        ...

    @property
    def trainer_cores(self) -> CoreLending | None:
        """Cores the trainer may borrow from replicas waiting for weights (a local CPU cluster)."""
        ...

    @property
    def local_rollout(self) -> RolloutRole | None:
        """The rollout worker in this process (inline), or None: replicas live elsewhere."""
        ...

    def __init__(self, config, spec: RolloutSpec, scorer: RewardWorker) -> None:
        """Place the replicas of `spec` (they may start building at once, beside the trainer's set-up); `scorer` is
        the driver's reward worker (used where the driver scores)."""

    @staticmethod
    def rank_launcher(config) -> Callable:
        """Where a multi-rank training engine's ranks run: the `Launcher` (`asyncflow.engines.fsdp2_train`) that
        starts them, on this runtime's machines. Static: the trainer is built without the runtime at hand."""
        ...

    def make_queue(self, tasks: list[str]): ...

    def start_rollout(self, queue, receiver_spec, steps: range, *, max_staleness: int, timeline: Timeline,
                      sampler_states: dict | None = None) -> None:
        """Run the rollout loop over `steps` on every replica; `sampler_states` (replica -> generator state)
        sets each engine's sampling generator first (a resumed run)."""
        ...

    def sampler_states(self, step: int, timeout: float) -> dict:
        """Replica -> its engine's generator state after partition `step`."""
        ...

    def reward_failures(self) -> dict[str, float]:
        """`reward/errors`, `reward/timeouts` of the replicas' scorers (totals); {} when the driver scores."""
        ...

    def weight_updates(self) -> dict[str, list]:
        """Replica -> the versions its engine took since the last call (`asyncflow.workers.loops.WeightUpdate`);
        a dead or restarting replica is left out."""
        ...

    def memory_metrics(self) -> dict[str, float]:
        """Peak resident memory of each replica in a process of its own (`memory/peak_rss_mb/rollout_R`,
        `asyncflow.observe.memory`); {} when the replicas run in the driver (its own peak covers them)."""
        ...

    def check(self) -> None:
        """Raise the failure of a replica."""
        ...

    def join(self, timeout: float) -> None: ...

    def close(self) -> None: ...
