"""The validated configuration tree of a run, loaded from YAML with dotted command-line overrides.

Owns: every knob of a run, documented field by field, and its loading/validation.

Invariants:
- An unknown key, a wrong type or an out-of-range value stops the run before any work, with an
  error naming the dotted key and what was expected (`ConfigError`).
- The resolved config (defaults filled in, overrides applied) is what the run writes to
  `RUN_DIR/config.yaml`; loading that file back gives the same config.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class RunConfig(Section):
    name: str = "run"
    """Name of the run (used in logs and plot titles)."""
    seed: int = 0
    """Seeds every random number generator in-process (torch, python, numpy, data order, sampling)."""
    output_dir: str = "runs/default"
    """Run folder: config.yaml, metrics.jsonl, checkpoints/, plots, timeline.json, tensorboard/."""
    progress: bool = True
    """Show a live progress bar on a terminal (plain log lines otherwise)."""


class ModelConfig(Section):
    path: str = "preset:tiny-llama"
    """A local Hugging Face model folder, or `preset:NAME` for a built-in tiny model (random init)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the policy."""
    device: str = "cpu"
    """`cpu` or `cuda[:N]`."""
    use_chat_template: bool | None = None
    """Render prompts with the tokenizer's chat template; `null` = when the tokenizer has one."""


class DataConfig(Section):
    task: str | None = "arithmetic"
    """Built-in task (`arithmetic`, `reverse`, `sort`, `countdown`, `tool_arithmetic`), or `reasoning_gym:NAME`
    (a dataset of reasoning-gym, scored by its own `score_answer`; the `reasoning_gym` extra); `null` to read
    `path` instead."""
    difficulty: int = Field(2, ge=1, le=5)
    """Difficulty of the built-in task."""
    task_options: dict[str, Any] = Field(default_factory=dict)
    """`reasoning_gym:NAME` only: the dataset's config keys as the library names them (its difficulty settings,
    e.g. `{min_terms: 2, max_terms: 3}`); `seed` and `size` are asyncflow's (splits are drawn from `run.seed`)."""
    partial_credit: bool = True
    """`reasoning_gym:NAME` only: the reward is the library's score, partial credit included (chain_sum pays 2/3 for
    "155" against the answer "55"); `false` pays only its full credit (1), the same test held-out accuracy uses."""
    train_size: int | None = Field(None, ge=1)
    """Distinct training problems drawn from the task; null = 50,000 for built-in tasks, 5,000 for
    reasoning-gym ones (some of its generators take milliseconds a problem)."""
    path: str | None = None
    """Training data file: `.jsonl`, `.parquet` or a saved HF dataset folder (when `task` is null)."""
    test_path: str | None = None
    """Held-out data file for evaluation (same formats); defaults to the task's test split."""
    prompt_field: str = "prompt"
    """Field of a data row holding the prompt text."""
    answer_field: str = "answer"
    """Field of a data row holding the ground truth passed to the reward."""
    test_size: int = Field(256, ge=0)
    """Number of held-out examples used for evaluation (0 = no evaluation, and no engine built for it)."""
    max_prompt_tokens: int = Field(256, ge=1)
    """Longest prompt accepted, in tokens."""
    on_long_prompt: Literal["skip", "error"] = "skip"
    """What to do with a longer prompt: skip it (and count it in `data/skipped_long_prompts_total`) or stop."""


class JudgeRewardConfig(Section):
    """A model-based reward: an entry of `reward.fns` that asks a judge model behind an OpenAI-compatible
    `/chat/completions` endpoint (`asyncflow serve`, vLLM, a hosted API) to score each completion. A judge call
    that fails (timeout, connection or HTTP error, no score in its answer) scores 0 and counts in
    `reward/errors`; it never stops the run by itself (`max_error_fraction` still applies)."""

    kind: Literal["judge"]
    """Marks this entry as a judge (`kind: judge`)."""
    base_url: str
    """The endpoint's OpenAI base URL, e.g. `http://127.0.0.1:8001/v1`."""
    model: str
    """The model name sent in each request."""
    name: str | None = None
    """The name it is logged under; default `judge:<model>`."""
    api_key_env: str | None = None
    """Environment variable holding the API key (sent as a bearer token); null = no key. The key itself never
    goes in the config, which the run writes to its folder."""
    system: str | None = None
    """Optional system message."""
    template: str = (
        "Question:\n{prompt}\n\nReference answer:\n{answer}\n\nResponse:\n{response}\n\n"
        "Is the response correct? Reply with 1 if it is, 0 if it is not."
    )
    """The user message, with `{prompt}` (the row's prompt text), `{response}` (the completion) and `{answer}`
    (the ground truth); literal braces are doubled (`{{`, `}}`)."""
    score_pattern: str = r"-?\d+(?:\.\d+)?"
    """Regular expression finding the score in the judge's answer: its first match (its first group, if it has
    one) is read as a number. An answer without a match is a reward error."""
    score_range: tuple[float, float] = (0.0, 1.0)
    """[low, high] of the judge's scores, mapped to a reward in [0, 1]; a score outside it is a reward error."""
    max_tokens: int = Field(16, ge=1)
    """Longest answer of the judge, in tokens."""
    temperature: float = Field(0.0, ge=0)
    """The judge's sampling temperature (0 = greedy, so identical requests may share a cached score)."""
    concurrency: int = Field(4, ge=1)
    """Requests of this judge in flight at once (per reward process)."""
    timeout_s: float = Field(30.0, gt=0)
    """Time limit of one request (connect, send, each read of the answer)."""
    retries: int = Field(2, ge=0)
    """Further attempts after a timeout, a connection error or HTTP 408/429/5xx, `backoff_s * 2**k` apart.
    All attempts of a sample together stop short of `reward.timeout_s` (set it to fit the judge's latency)."""
    backoff_s: float = Field(1.0, ge=0)
    """Wait before the first retry (doubling after each)."""
    cache_size: int = Field(4096, ge=0)
    """Scores of identical requests kept (an identical request in flight is waited for, not sent again);
    0 = no cache."""

    @model_validator(mode="after")
    def _check_judge(self) -> JudgeRewardConfig:
        from asyncflow.rewards.judge import JudgeReward

        JudgeReward(**self.judge_options())  # checks the template, the pattern and the range; sends nothing
        return self

    def judge_options(self) -> dict[str, Any]:
        """Keyword arguments of `asyncflow.rewards.judge.JudgeReward`."""
        return self.model_dump(exclude={"kind"})


def _reward_entry_kind(entry: Any) -> str | None:
    if isinstance(entry, dict):
        return entry.get("kind")
    return "judge" if isinstance(entry, JudgeRewardConfig) else "function"


#: An entry of `reward.fns`: a name or spec string, or a mapping tagged by its `kind` (`judge`); told apart before
#: validation, so an error names what is wrong with the entry as written.
RewardEntry = Annotated[
    Annotated[str, Tag("function")] | Annotated[JudgeRewardConfig, Tag("judge")], Discriminator(_reward_entry_kind)
]


class RewardConfig(Section):
    fns: list[RewardEntry] = Field(default=["auto"])  # pydantic copies a mutable default per instance
    """Reward functions: registered names (`exact_match`, `numeric_match`, `math_verify`, `format`, ...),
    `package.module:function`, or a judge model (a mapping with `kind: judge`, see `JudgeRewardConfig`). `auto` =
    the verifier of the built-in task."""
    weights: list[float] | None = None
    """Weights of `fns` (default: all 1)."""
    timeout_s: float = Field(5.0, gt=0)
    """Time limit per sample, from the moment it starts; a reward that raises, returns something that is not a
    finite number (None, a string, NaN, ...) or exceeds it scores 0 and is counted in `reward/errors` /
    `reward/timeouts`."""
    workers: int = Field(4, ge=1)
    """Threads (or, with `isolation: process`, processes) scoring rewards concurrently."""
    isolation: Literal["thread", "process"] = "thread"
    """Where reward functions run: `thread` (cheapest; a hung call cannot be stopped, its thread is counted as
    stuck, see `max_stuck_calls`) or `process` (worker processes, killed and replaced when a call exceeds
    `timeout_s`; for functions that may hang; they must be module-level, importable functions)."""
    max_stuck_calls: int = Field(8, ge=0)
    """`thread` isolation: reward calls still running past `timeout_s` (threads that cannot be stopped) tolerated
    at once; one more stops the run with an error instead of leaking a thread per sample."""
    max_error_fraction: float | None = Field(0.5, ge=0, le=1)
    """A step fails when more than this fraction of its samples failed (errors + timeouts); 0 or null disables
    the limit."""
    max_error_steps: int | None = Field(3, ge=0)
    """Stop the run after this many failing steps in a row (see `max_error_fraction`); 0 or null disables."""
    columns: dict[str, float] = Field(default_factory=dict)
    """Per-row columns written by `stages`, added to the reward with these weights before advantages
    (e.g. `{brevity: 0.1}`)."""


def _changed_fields(section: BaseModel) -> list[str]:
    """The fields of `section` set to other values than their defaults (nested sections as a whole)."""
    fields = type(section).model_fields
    return [k for k in fields if getattr(section, k) != fields[k].get_default(call_default_factory=True)]


class VLLMConfig(Section):
    """The `vllm` rollout engine's settings (`rollout.engine: vllm`; docs/vllm.md)."""

    gpu_memory_fraction: float = Field(0.4, gt=0, le=1)
    """On a GPU: the share of the device's memory each engine may take (weights, activations, KV cache; vLLM's
    `gpu_memory_utilization`). The default leaves room for a trainer on the same GPU; raise it when the rollout
    engine has the GPU to itself."""
    kv_cache_gb: float | None = Field(None, gt=0)
    """KV cache size per engine in GiB (vLLM's `kv_cache_memory_bytes`); null = sized from `gpu_memory_fraction`
    on a GPU, from the model and `rollout.max_batch_size` on a CPU."""
    weight_transfer: Literal["collective", "file"] = "file"
    """How new weights reach vLLM's workers (docs/vllm-weights.md). `collective`: the process that owns the engine
    and vLLM's workers share a process group (gloo on CPU, NCCL on CUDA, which needs them on different GPUs) and
    each version is broadcast as a few large buckets straight into the model, no file on the way. `file`: a
    safetensors file in /dev/shm that the workers reload; the default, as on vLLM's CPU build it measured faster
    than gloo over TCP loopback (BENCHMARKS.md)."""

    executor: Literal["mp", "uni"] | None = None
    """Where vLLM runs the model (its `distributed_executor_backend`, for one device). `uni`: inside vLLM's engine-core
    process; `mp`: in a worker process of its own beside it, one process more to start and stop; null: vLLM's
    choice, `mp` on a CPU (vLLM sets OpenMP threads up for that process) and `uni` on one GPU. On a 2-core CPU an
    engine with `uni` started in 9.6 s against 15.2 s (19 against 27 CPU-seconds) and generated within 0.7-1.3x of
    `mp`'s time, depending on the model (docs/vllm.md)."""

    def factory_options(self, runtime: RuntimeConfig | None = None) -> dict[str, Any]:
        """These settings as keyword arguments of `asyncflow.engines.vllm_engine`'s factory; with `runtime`, the
        engine's own waits (its start; each call inside it: a weight update's group join and broadcasts, a
        generation that makes no progress) end within `runtime.start_timeout_s` / `runtime.call_timeout_s`."""
        options: dict[str, Any] = {"weight_transfer": self.weight_transfer,
                                   "gpu_memory_utilization": self.gpu_memory_fraction}
        if runtime is not None:
            options |= {"start_timeout_s": runtime.start_timeout_s, "call_timeout_s": runtime.call_timeout_s}
        if self.kv_cache_gb is not None:
            options["kv_cache_memory_bytes"] = int(self.kv_cache_gb * 2**30)
        if self.executor is not None:
            options["distributed_executor_backend"] = self.executor
        return options


class RolloutConfig(Section):
    engine: str = "torch"
    """Inference engine from the registry (or `package.module:factory`)."""
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    """Settings of the `vllm` engine (refused with another engine)."""
    engine_options: dict[str, Any] = Field(default_factory=dict)
    """Further keyword arguments of the engine's factory (for `vllm`: any `AsyncEngineArgs` field); they take
    precedence over the engine's own section."""
    prompts_per_step: int = Field(32, ge=1)
    """Prompts per training step (each sampled `group_size` times)."""
    group_size: int = Field(8, ge=1)
    """Responses per prompt (the GRPO group)."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature (0 = greedy)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    top_k: int = Field(0, ge=0)
    """Top-k filter (0 = off)."""
    max_new_tokens: int = Field(16, ge=1)
    """Longest response, in tokens."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Token ids that end a response besides the tokenizer's EOS (the stop token is kept in the response)."""
    max_batch_size: int = Field(128, ge=1)
    """Concurrent sequences in the inference engine (continuous batching slots)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter dtype of the rollout (and evaluation) engine's copy of the policy; each weight update is cast
    to it. `auto`: bfloat16 when `train.precision` is `bf16` (rollouts in the trainer's compute dtype, as the
    anchors run vLLM next to a bf16 trainer), else `model.dtype`."""
    replicas: int = Field(1, ge=1)
    """Rollout workers (separated runtimes)."""
    on_weight_update: Literal["finish", "resume"] = "finish"
    """What samples in flight do when new weights reach a rollout worker mid-partition (`async` only: `sync`
    and `stream` never update weights during generation). `finish`: they complete on the weights they started
    with; the new ones are swapped in between partitions. `resume` (partial rollouts): the engine takes the new
    weights at its next decode step, and every in-flight sample goes on under them from the tokens it already
    has (its KV cache recomputed); each token records the version that sampled it, trains against its own
    sampling log-prob, and a row counts for `workflow.max_staleness` by its oldest token. Needs an engine with
    `updates_in_flight` (the built-in `torch` engine has it)."""

    @model_validator(mode="after")
    def _engine_sections_of_the_chosen_engine(self) -> RolloutConfig:
        """An engine's own section, changed while another engine runs, would do nothing: refused."""
        changed = _changed_fields(self.vllm)
        if self.engine != "vllm" and changed:
            raise ValueError(f"rollout.vllm.{changed[0]} applies to rollout.engine=vllm only, but rollout.engine is "
                             f"{self.engine}")
        return self

    def factory_options(self, runtime: RuntimeConfig | None = None) -> dict[str, Any]:
        """Keyword arguments of the engine's factory: its own section's (its timeouts from `runtime`), then
        `engine_options`."""
        own = self.vllm.factory_options(runtime) if self.engine == "vllm" else {}
        return {**own, **self.engine_options}


class EnvConfig(Section):
    name: str | None = None
    """Multi-turn environment: a registered name (`calculator`: the calculator tool; `tools`: calculator and
    sandboxed Python) or `package.module:factory`; `null` = single-turn rollouts. The final answer is scored
    by `reward.fns`. Or `verifiers:MODULE_OR_ID`, an environment of the `verifiers` library
    (`asyncflow.envs.verifiers_env`; the `verifiers` extra): MODULE_OR_ID is a module or `path/to/file.py` defining
    `load_environment(**env.options)`, or an installed environment's id. Its dataset is the training data (not
    `data.task` / `data.path`; `data.train_size` caps it), its rollouts (single- or multi-turn, its own turn limit)
    are episodes through this run's OpenAI-compatible server (`agent.concurrency`, `agent.episode_timeout_s`,
    `agent.chat_template` apply; the model needs a chat template), trained on the token ids sampled, and its
    rubric's reward is the reward (each reward function's score logged as `agent/scores/<name>`)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of a `verifiers:` environment's `load_environment` (plain YAML values)."""
    max_turns: int = Field(4, ge=1)
    """Model turns per episode; an episode still without a final answer after them ends with finish reason
    `length` and reward 0."""
    max_context_tokens: int = Field(512, ge=2)
    """Longest transcript (prompt, model turns and observations), in tokens; past it the episode ends with
    finish reason `length` and reward 0. At most the model's context length."""
    concurrency: int | None = Field(None, ge=1)
    """Episodes in flight per rollout worker (threads; each waits on the engine or on its tools); `null` =
    `rollout.max_batch_size`."""
    tool_timeout_s: float = Field(5.0, gt=0)
    """Wall-clock limit of one tool call; a call past it becomes an error observation (counted in
    `env/tool_timeouts`)."""
    tool_workers: int = Field(8, ge=1)
    """Threads running tool calls concurrently (per rollout worker)."""
    max_tool_output_chars: int = Field(512, ge=16)
    """An observation longer than this is cut (the model sees `...[truncated]`)."""
    python_isolation: Literal["strict", "weak"] = "strict"
    """How the `python` tool's model-written code is isolated: `strict`, inside a bubblewrap sandbox (own user,
    PID, network, IPC and mount namespaces, an unprivileged uid with no capabilities even when the trainer is root,
    empty environment, read-only system, private size-limited /tmp, at most 16 threads; the run refuses to start
    where bubblewrap cannot run); `weak`, the audit hook and rlimits only (not a security boundary:
    docs/security.md)."""
    python_cpu_s: int = Field(2, ge=1)
    """`python` tool: CPU-time limit of the child process (RLIMIT_CPU)."""
    python_memory_mb: int = Field(256, ge=32)
    """`python` tool: address-space limit of the child process (RLIMIT_AS)."""
    python_max_output_bytes: int = Field(4096, ge=64)
    """`python` tool: stdout + stderr beyond this stop the child (RLIMIT_FSIZE) and become an error."""


class PPOLossConfig(Section):
    """`algo.loss: ppo` (the default): the clipped surrogate on each token's ratio pi/pi_old (PPO, GRPO, DAPO)."""

    kind: Literal["ppo"] = "ppo"
    """The loss (`algo.loss: ppo` is this kind at its defaults)."""
    clip_low: float = Field(0.2, ge=0)
    """Lower clip range (ratio >= 1 - clip_low)."""
    clip_high: float = Field(0.28, ge=0)
    """Upper clip range (DAPO clip-higher: ratio <= 1 + clip_high)."""


class GSPOLossConfig(Section):
    """`algo.loss: gspo`: the clipped surrogate on each response's sequence ratio, the geometric mean of its tokens'
    ratios (GSPO; the paper aggregates with `algo.loss_agg: seq_mean_token_mean`)."""

    kind: Literal["gspo"] = "gspo"
    """The loss (`algo.loss: gspo` is this kind at its defaults)."""
    clip_low: float = Field(3e-4, ge=0, lt=1)
    """Lower clip range (sequence ratio >= 1 - clip_low); the default is the GSPO paper's."""
    clip_high: float = Field(4e-4, ge=0)
    """Upper clip range (sequence ratio <= 1 + clip_high); the default is the GSPO paper's."""


class CISPOLossConfig(Section):
    """`algo.loss: cispo`: every token's log-prob gradient weighted by its clipped, stop-gradient ratio, no token
    dropped (CISPO, MiniMax-M1; the paper aggregates with `token_mean`)."""

    kind: Literal["cispo"] = "cispo"
    """The loss (`algo.loss: cispo` is this kind at its defaults)."""
    clip_low: float = Field(1.0, ge=0, le=1)
    """Lower clip range (IS weight >= 1 - clip_low); 1 = no lower bound, as MiniMax-M1 trained."""
    clip_high: float = Field(3.0, ge=0)
    """Upper clip range (IS weight <= 1 + clip_high). MiniMax-M1 tuned it without publishing a value; 3 (weights
    <= 4) is Tinker's default CISPO cap."""


def _loss_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("kind", "ppo")
    return getattr(value, "kind", value if isinstance(value, str) else None)


#: `algo.loss`: a loss name (its clip range at the defaults) or a mapping `{kind: NAME, clip_low: ..., clip_high:
#: ...}`; a mapping without `kind` is the default loss, `ppo`.
PolicyLossConfig = Annotated[
    Annotated[PPOLossConfig, Tag("ppo")] | Annotated[GSPOLossConfig, Tag("gspo")]
    | Annotated[CISPOLossConfig, Tag("cispo")],
    Discriminator(_loss_kind),
]


# The names, the ratio weights, the thresholded corrections and `MismatchConfig`'s defaults repeat
# `asyncflow.algos.correction`'s (a test keeps them equal): this module does not import torch.
#: `algo.mismatch_correction`'s names (`asyncflow.algos.correction.MISMATCH_CORRECTIONS`).
MismatchCorrection = Literal["off", "token_tis", "geo_mis", "icepop", "seq_tis", "seq_mask", "m2po"]
_RATIO_CORRECTIONS = ("token_tis", "icepop", "seq_tis")  # weight each token by its ratio: one per combination
_THRESHOLD_KEYS = {"token_tis": "token_tis_cap", "geo_mis": "geo_mis_threshold", "seq_tis": "seq_tis_cap",
                   "seq_mask": "seq_mask_threshold"}  # what `algo.mismatch_threshold` sets, by correction


class MismatchConfig(Section):
    """Each train/inference mismatch correction's parameters (`algo.mismatch_correction`;
    `asyncflow.algos.correction`), at the defaults of the frameworks that ship them. A key of a correction
    that is not chosen is refused."""

    token_tis_cap: float = Field(2.0, gt=1)
    """`token_tis`: the cap of each token's weight min(ratio, cap) (verl's default)."""
    geo_mis_threshold: float = Field(1.001, gt=1)
    """`geo_mis`: a response is kept when its geometric-mean ratio lies in [1/c, c] (verl's geo_mis preset)."""
    seq_tis_cap: float = Field(2.0, gt=1)
    """`seq_tis`: the cap of each response's weight min(prod_t ratio_t, cap) (verl `rollout_is_threshold`)."""
    seq_mask_threshold: float = Field(2.0, gt=1)
    """`seq_mask`: a response is kept when its sequence ratio prod_t ratio_t lies in [1/c, c] (verl
    `rollout_rs_threshold`, which defaults to `rollout_is_threshold`, 2)."""
    # Every key starts with its correction's name (`icepop_low` is icepop's): how a key not in use is found.
    icepop_low: float = Field(0.5, gt=0, le=1)
    """`icepop`: a token whose ratio is below this is masked (IcePop's alpha, OpenRLHF's default)."""
    icepop_high: float = Field(5.0, ge=1)
    """`icepop`: a token whose ratio is above this is masked (IcePop's beta, OpenRLHF's default)."""
    m2po_tau: float = Field(0.04, gt=0)
    """`m2po`: the bound on the mean squared log-ratio of the kept tokens (M2PO's tau)."""


class CriticConfig(Section):
    """The value model of PPO with a critic (`algo.advantage: gae`; `asyncflow.models.value`)."""

    kind: Literal["head", "separate"] = "head"
    """`head`: a linear value head on the policy's last hidden states (one forward gives log-probs and values);
    `separate`: a model of its own (`path`) with such a head, run in the same (packed) layout as the policy."""
    path: str | None = None
    """`separate`: a local Hugging Face model folder, `preset:NAME` or a run's checkpoint folder, loaded like
    `model.path`; `null` = `model.path` (the critic starts from the policy's weights)."""
    lr: float | None = Field(None, gt=0)
    """Learning rate of the critic's parameters (its own AdamW group, on `train.lr_schedule`); `null` =
    `train.lr`."""
    train_trunk: bool = True
    """`head`: the value loss also trains the shared trunk (scaled by `value_coef`); `false` = the head learns on
    detached hidden states and the policy's gradient is the policy loss's alone."""
    value_coef: float = Field(0.5, ge=0)
    """Value loss weight: the loss is the policy loss + value_coef * the value loss."""
    value_clip: float | None = Field(0.2, gt=0)
    """Clip of the value loss: each value may move at most this far from its old value (PPO's clipped value
    loss, 0.5 * max((V - R)^2, (V_clip - R)^2)); `null` = unclipped. The old values are the critic's before
    this step's update and one update is taken per step, so within a step V = V_old and the clip does not
    act (`value/clip_fraction` is 0); it is kept for updates that reuse a batch."""


class AlgoConfig(Section):
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"] = "grpo"
    """Advantage estimator. `gae`: PPO with a critic (`algo.critic`): each response's reward on its last trained
    token, the critic's values (before this step's update) and `gamma` / `lam` give per-token GAE advantages and
    returns (advantages + values), per row and not whitened; the critic is trained on the returns with the
    clipped value loss (`critic.value_clip`, `critic.value_coef`) next to the policy. The KL penalty (`kl_coef`)
    stays in the loss, not in the rewards."""
    loss: PolicyLossConfig = Field(default_factory=PPOLossConfig)
    """Policy loss (`asyncflow.algos.losses`) and its clip range, by name (`ppo`, `gspo`, `cispo`) or as
    `{kind: NAME, clip_low: L, clip_high: H}` (dotted: `algo.loss=gspo algo.loss.clip_high=5e-4`): `ppo`, the
    clipped surrogate on each token's ratio pi/pi_old (PPO, GRPO, DAPO); `gspo`, the clipped surrogate on each
    response's sequence ratio, the geometric mean of its tokens' ratios (GSPO); `cispo`, every token's log-prob
    gradient weighted by its clipped, stop-gradient ratio, no token dropped (CISPO, MiniMax-M1). Each kind has
    its own clip keys and defaults (`PPOLossConfig`, `GSPOLossConfig`, `CISPOLossConfig`). With one update per
    step on rows of the current policy every ratio is 1 and the three give the same gradient; they differ on
    stale rows (`workflow.mode: async` with `stale_old_logprobs: rollout`)."""
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "token_mean"
    """How per-token losses become one number."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the reference model (0 = no reference forward)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus weight."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount (GAE, REINFORCE++)."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal."""
    overlong_filter: bool = False
    """Exclude responses cut at `max_new_tokens` from the loss."""
    mismatch_correction: MismatchCorrection | list[MismatchCorrection] = "off"
    """Correction of the policy loss for the train/inference mismatch (the trainer's recomputed log-probs vs the
    engine's sampling log-probs; `asyncflow.algos.correction`, docs/workflows.md for when to use which), with
    ratio = pi_train / pi_rollout per token: `off`; `token_tis`, truncated importance sampling, each token's
    loss weighted by min(ratio, cap) (TIS; verl `rollout_is: token`, slime `--use-tis`); `icepop`, each token
    weighted by its ratio inside [icepop_low, icepop_high] and left out of the loss outside it (IcePop;
    OpenRLHF `--use_icepop`); `seq_tis`, each response weighted by min(prod_t ratio_t, cap) (verl
    `rollout_is: sequence`); `seq_mask`, a response whose sequence ratio prod_t ratio_t leaves [1/c, c] is
    left out (verl `rollout_rs: sequence`); `geo_mis`, the same on the geometric mean exp(mean_t log ratio_t)
    (verl `rollout_rs: geometric`, its `geo_mis` preset); `m2po`, the tokens with the largest squared
    log-ratio are left out until the mean over the rest is <= m2po_tau (M2PO; computed per micro-batch: see
    docs/workflows.md). A list (or `a+b`) combines them, the weights multiplying: at most one of token_tis,
    icepop, seq_tis with any of the masks geo_mis, seq_mask, m2po (e.g. `[token_tis, seq_mask]`, verl's IS
    weight with a rejection mask). Their parameters are `algo.mismatch`. The ratio is taken against PPO's old
    log-probs, so a token trained against its own sampling log-prob (stale, with `stale_old_logprobs:
    rollout`) has ratio 1; with `stale_old_logprobs: policy` it also corrects for staleness (AReaL's decoupled
    objective)."""
    mismatch_threshold: float | None = Field(None, gt=1)
    """Shorthand for the one number of a single `token_tis` (`mismatch.token_tis_cap`), `geo_mis`
    (`mismatch.geo_mis_threshold`), `seq_tis` (`mismatch.seq_tis_cap`) or `seq_mask`
    (`mismatch.seq_mask_threshold`): the cap or band of `mismatch_correction`; `null` = that key's value
    (defaults 2.0, 1.001, 2.0, 2.0). Refused where it would not name one number (icepop, m2po, or two of those)."""
    mismatch: MismatchConfig = Field(default_factory=MismatchConfig)
    """The parameters of each mismatch correction (`mismatch_correction`)."""
    stale_old_logprobs: Literal["rollout", "policy"] = "rollout"
    """PPO's old log-probs for a row generated by an older weight version (`async`): `rollout`, the
    log-probs its generating policy recorded (ratio and clip against the behaviour policy, which corrects
    for staleness), or `policy`, the current policy (ratio 1: trained as if on-policy). Rows of the
    current version always use the current policy."""
    teacher: str | None = None
    """On-policy distillation (`asyncflow.algos.distill`): the teacher model, a Hugging Face folder, `preset:NAME`, a
    run folder (its latest checkpoint) or a checkpoint folder `RUN_DIR/checkpoints/step_N`, with the policy's
    tokenizer. It takes the reference model's place in the tri-model forward (frozen, never saved in checkpoints) and
    each sampled token's advantage becomes `teacher_coef * -(log pi_student - log pi_teacher)` (the reverse-KL
    estimator), plus the reward's advantage when `teacher_with_reward`. Refused with `kl_coef > 0`: the one frozen
    model slot holds either the reference or the teacher (the reverse KL to the teacher already keeps the policy
    near a fixed model)."""
    teacher_coef: float = Field(1.0, gt=0)
    """Weight of the distillation advantage (`teacher` only)."""
    teacher_with_reward: bool = False
    """`teacher` only: add the reward's advantage (`advantage` estimator) to the distillation advantage; `false`
    trains on distillation alone (rewards are still scored and logged as `reward/*`, but not trained on)."""
    critic: CriticConfig = Field(default_factory=CriticConfig)
    """The value model (`advantage: gae` only)."""
    router_replay: bool = False
    """Router replay (R3) for a mixture-of-experts policy (`asyncflow.models.moe`, docs/models.md): the rollout
    engine records the experts each router chose at every position (a `routed_experts` column, uint8), and the
    trainer's policy forward routes each token to those experts, its routers still trained through their gate
    values (softmax at the replayed experts). Needs `rollout.engine: torch` (vLLM's CPU build cannot return its
    routing) and single-turn rollouts; the reference model routes on its own."""
    @field_validator("loss", mode="before")
    @classmethod
    def _loss_by_name(cls, value: Any) -> Any:
        """`loss: gspo` = `loss: {kind: gspo}` (its clip range at the defaults)."""
        return {"kind": value} if isinstance(value, str) else value

    @field_validator("mismatch_correction", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        """YAML 1.1 reads a bare `off` as false; `a+b` is the list `[a, b]`."""
        if value is False:
            return "off"
        if isinstance(value, str) and "+" in value:
            return [part.strip() for part in value.split("+")]
        if isinstance(value, list):
            return ["off" if v is False else v for v in value]
        return value

    @field_validator("mismatch_correction")
    @classmethod
    def _one_combination(cls, value: str | list[str]) -> str | list[str]:
        """A list of one is that name; `off` stands alone, no name twice, at most one ratio weight."""
        if isinstance(value, str):
            return value
        if not value:
            raise ValueError("give a correction, a list of corrections, or off")
        if len(value) == 1:
            return value[0]
        if "off" in value or len(set(value)) != len(value):
            raise ValueError(f"{value}: off cannot be combined, and no correction can be named twice")
        ratios = [v for v in value if v in _RATIO_CORRECTIONS]
        if len(ratios) > 1:
            raise ValueError(f"{ratios} both weight each token by its ratio: combine at most one of "
                             f"{list(_RATIO_CORRECTIONS)} with any of the masks geo_mis, seq_mask, m2po")
        return value

    def mismatch_corrections(self) -> list[str]:
        """The chosen mismatch corrections (`[]` for off)."""
        chosen = [self.mismatch_correction] if isinstance(self.mismatch_correction, str) else self.mismatch_correction
        return [c for c in chosen if c != "off"]

    @model_validator(mode="after")
    def _mismatch_keys_of_the_chosen_corrections(self) -> AlgoConfig:
        """`mismatch_threshold` names one number, and an `algo.mismatch` key of a correction not chosen would do
        nothing: both refused where they do not apply."""
        chosen = self.mismatch_corrections()
        if self.mismatch_threshold is not None:
            thresholded = [c for c in chosen if c in _THRESHOLD_KEYS]
            if len(thresholded) != 1:
                raise ValueError(
                    f"algo.mismatch_threshold sets the one number of a single token_tis, geo_mis, seq_tis or seq_mask, "
                    f"but algo.mismatch_correction is {self.mismatch_correction}: set algo.mismatch.* instead")
            key = _THRESHOLD_KEYS[thresholded[0]]
            if key in _changed_fields(self.mismatch):
                raise ValueError(f"algo.mismatch_threshold and algo.mismatch.{key} set the same number: keep one")
        for key in _changed_fields(self.mismatch):
            owner = next(c for c in typing.get_args(MismatchCorrection) if key.startswith(f"{c}_"))
            if owner not in chosen:
                raise ValueError(f"algo.mismatch.{key} applies to algo.mismatch_correction={owner} only, but "
                                 f"algo.mismatch_correction is {self.mismatch_correction}")
        return self

    @model_validator(mode="after")
    def _teacher_or_reference(self) -> AlgoConfig:
        if self.teacher is not None and self.kl_coef > 0:
            raise ValueError(
                f"algo.teacher with algo.kl_coef={self.kl_coef}: the teacher takes the reference model's place in the "
                "tri-model forward, so a KL penalty to the initial policy and distillation cannot run together; set "
                "algo.kl_coef=0 (the reverse KL to the teacher is the regulariser) or drop algo.teacher"
            )
        return self

    @model_validator(mode="after")
    def _critic_keys_need_gae(self) -> AlgoConfig:
        """A critic key changed while no critic is trained would do nothing: refused."""
        changed = _changed_fields(self.critic)
        if self.advantage != "gae" and changed:
            raise ValueError(f"algo.critic.{changed[0]} applies to algo.advantage=gae (PPO with a critic) only, "
                             f"but algo.advantage is {self.advantage}")
        return self


ADAPTER_ENGINES = ("torch", "vllm")  # rollout engines that apply LoRA adapters (`train.lora.sync: adapter`)


class LoRAConfig(Section):
    rank: int = Field(0, ge=0)
    """LoRA rank r; 0 = off (full fine-tuning). With r > 0 the policy's `target_modules` get adapters (through
    peft: the `lora` extra, `pip install 'asyncflow-rl[lora]'`); only the adapters are trained and optimized,
    the base weights stay frozen. What rollout engines receive per weight version is `sync`'s choice."""
    alpha: float = Field(16.0, gt=0)
    """LoRA scaling numerator: the update is `alpha / rank * B @ A`."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input during training. Above 0 the training-side log-probs are noisy while
    rollout samples without dropout."""
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    """Names (last component) of the linear modules that get adapters, or `all-linear` (every linear layer
    but the output head). Embeddings and the output head are not supported (they are tied in the presets)."""
    sync: Literal["adapter", "merged"] = "adapter"
    """What a weight version carries to the rollout engines. `adapter`: the adapter's A/B tensors alone (about
    rank * (1/d_in + 1/d_out) of each targeted weight's bytes); each engine loads the base weights once from
    `model.path` and applies the adapter (the built-in engine with the trainer's LoRA layers, vLLM as one LoRA
    adapter per version, each request finishing on the adapter it started with). Needs `rollout.engine` `torch`
    or `vllm`, and with vLLM target modules its LoRA takes (refused at the engine's start otherwise). `merged`:
    the full weights, base + alpha/r * B @ A, loaded by any engine as full fine-tuning's are."""

    @field_validator("rank")
    @classmethod
    def _peft_installed(cls, value: int) -> int:
        if value > 0:
            import importlib.util

            if importlib.util.find_spec("peft") is None:
                raise ValueError("LoRA needs peft: pip install 'asyncflow-rl[lora]' (or set train.lora.rank=0)")
        return value

    @field_validator("target_modules")
    @classmethod
    def _linear_layers_only(cls, value: list[str] | str) -> list[str] | str:
        if not value:
            raise ValueError("give at least one module name, or all-linear")
        tied = sorted({"lm_head", "embed_tokens"} & set(value)) if isinstance(value, list) else []
        if tied:
            raise ValueError(f"{tied}: adapters on embeddings or the output head are not supported")
        return value


class TrainConfig(Section):
    steps: int = Field(100, ge=1)
    """Training steps (one optimizer step each)."""
    engine: str = "torch"
    """Training engine from the registry (or `package.module:factory`): `torch`, the built-in single-process
    engine (CPU or one GPU), or `fsdp2`, the policy sharded over `world_size` ranks with FSDP2 (gloo on CPU,
    NCCL on GPU; the ranks are Ray actors under the Ray runtime, local processes otherwise)."""
    world_size: int = Field(1, ge=1)
    """Ranks of a multi-rank engine (`fsdp2`); the built-in `torch` engine takes 1. Each rank gets
    `torch threads // world_size` threads on CPU (`--threads`), one GPU each on GPU."""
    lr: float = Field(1e-4, gt=0)
    """Peak learning rate (AdamW)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global gradient norm."""
    micro_batch_size: int = Field(64, ge=1)
    """Sequences per forward/backward (gradient accumulation over the step's batch); with
    `max_tokens_per_micro_batch`, the most sequences a micro-batch may hold."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=1)
    """Token budget of a micro-batch: rows are packed, longest first and GRPO groups together where they fit, into
    micro-batches of at most this many forward tokens counted with padding (rows x longest prompt + response), so
    activation memory is bounded whatever the response lengths; a single longer row runs alone. The update is the
    same as with any other split (losses are sums normalised once per step). `null` = `micro_batch_size` rows."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Decay after warm-up."""
    max_nan_steps: int = Field(3, ge=1)
    """Stop after this many consecutive steps with a non-finite loss (each is skipped and logged)."""
    packing: Literal["auto", "on", "off"] = "auto"
    """Shared-prompt packing of GRPO groups in the training forward (`auto`: by the rule
    `models.tri_model.should_pack`)."""
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    """LoRA adapters instead of full fine-tuning (`rank` > 0 turns them on)."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """Compute precision of the training forward and backward. `bf16`: mixed precision, matmuls and activations
    in bfloat16 (`torch`: autocast; `fsdp2`: `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`) while
    master weights, gradients, their reduction across ranks and AdamW state stay float32 (so `model.dtype` must
    be float32); log-probs and the loss are computed in float32 from the bf16 logits. About half the activation
    memory, and much faster on GPUs; on a CPU without native bf16 it is slower."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them from the forward
    (Hugging Face gradient checkpointing, non-reentrant): activation memory of one layer instead of all, for
    about one extra forward of compute. Gradients are unchanged."""
    router_aux_loss_coef: float | None = Field(None, ge=0)
    """Mixture-of-experts policies: the weight of the load-balancing loss added to each micro-batch's loss (logged
    as `moe/load_balancing_loss`: experts per token when balanced, up to the number of experts); `null` = the model
    config's own `router_aux_loss_coef` (0.001 for Qwen3-MoE and Mixtral), `0` = logged only. Ignored for dense
    models."""

    @model_validator(mode="after")
    def _single_process_engine(self) -> TrainConfig:
        if self.engine == "torch" and self.world_size != 1:
            raise ValueError(f"train.world_size={self.world_size} needs a multi-rank engine (train.engine=fsdp2); "
                             "the built-in torch engine runs one process")
        if self.lora.rank and self.engine != "torch":
            raise ValueError(f"train.lora needs train.engine=torch: the {self.engine} engine does not train "
                             "LoRA adapters yet (set train.lora.rank=0)")
        return self

    @field_validator("packing", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        """YAML 1.1 reads a bare `on`/`off` as a boolean."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class SFTConfig(Section):
    steps: int = Field(300, ge=0)
    """Most supervised steps on (prompt, answer) pairs: all of them without `stop_accuracy`; with it, the
    bound on a run that does not reach the target (which then ends with a warning)."""
    batch_size: int = Field(64, ge=1)
    """Pairs per step."""
    lr: float = Field(1e-3, gt=0)
    """Peak AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.98)
    """SFT's AdamW betas (the training engine is built with the `sft.*` optimizer settings, not `train.*`)."""
    weight_decay: float = Field(0.01, ge=0)
    """SFT's AdamW weight decay."""
    grad_clip: float = Field(1.0, gt=0)
    """SFT's gradient-norm clip."""
    warmup_steps: int = Field(10, ge=0)
    """Linear LR warm-up steps."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "cosine"
    """LR after warm-up: `cosine`/`linear` decay to 0 at `steps`; `constant` suits `stop_accuracy`, whose stop
    step is not known in advance (a decay would make the LR at the stop depend on `steps`)."""
    stop_accuracy: float | None = Field(None, ge=0, le=1)
    """Stop at the first check whose greedy accuracy on the validation split is >= this (`null` = run `steps`).
    Validation is measured as the RL run measures held-out accuracy, on prompts disjoint from its test split."""
    check_every: int = Field(10, ge=1)
    """Steps between validation checks when `stop_accuracy` is set (one more check at `steps`)."""
    validation_size: int = Field(256, ge=1)
    """Validation prompts per check: the built-in task's validation split, or the rows of `data.path` whose
    prompt falls in the validation part of the fixed partition (about 5% of distinct prompts, kept out of SFT)."""
    before_rl: bool = False
    """`asyncflow train` first runs SFT (unless its output already exists) and starts RL from its result."""
    output: str | None = None
    """Folder of the warm-started model (an HF folder, with `sft_summary.json`); `null` = `RUN_DIR/sft`."""


class EvalConfig(Section):
    """Held-out accuracy of the policy. `sync` generates it on the idle rollout engine; the other modes with the
    trainer's own policy module through the torch engine (whatever `rollout.engine` is: no second copy of the
    weights, no second vLLM), and an FSDP2 trainer on an engine of its own loaded with the weights."""

    every: int = Field(10, ge=0)
    """Evaluate on the held-out split every N steps (0 = only at the end)."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature during evaluation (0 = greedy)."""
    max_new_tokens: int | None = None
    """Defaults to `rollout.max_new_tokens`."""


class CheckpointConfig(Section):
    every: int = Field(50, ge=0)
    """Checkpoint every N steps (0 = only at the end)."""
    keep: int = Field(2, ge=1)
    """Checkpoints kept on disk (oldest removed)."""


class ExportConfig(Section):
    at_end: bool = True
    """When training ends, export the final checkpoint to `RUN_DIR/export` as `asyncflow export` does: a
    Hugging Face folder (config.json, safetensors, tokenizer) that transformers and vLLM load; under LoRA the
    adapter in peft format (see `merged`)."""
    merged: bool = False
    """LoRA only: also write the merged weights as a full Hugging Face model (the adapter then goes to
    `export/adapter/`). Without LoRA the export is always the full model."""


class WorkflowConfig(Section):
    mode: Literal["sync", "stream", "async"] = "sync"
    """`sync` colocated baseline; `stream` periodic asynchrony (on-policy); `async` bounded staleness."""
    max_staleness: int = Field(1, ge=1)
    """`async` only: a row is trained on weights at most this many versions newer than its own."""


class RuntimeConfig(Section):
    kind: Literal["auto", "inline", "ray"] = "auto"
    """`inline`: every worker in this process (threads); `ray`: rollout replicas as Ray actors on a local
    cluster started for you (or the one at `address`); `auto`: `inline` for the colocated `sync`
    baseline, `ray` for `stream` and `async` (`inline` with `agent.fn`)."""
    address: str | None = None
    """Ray cluster address to join; `null` starts a local cluster."""
    num_cpus: int | None = None
    """CPUs of the local Ray cluster (default: all)."""
    rollout_cpus: float = Field(1.0, gt=0)
    """CPUs per rollout worker."""
    trainer_cpus: float = Field(1.0, gt=0)
    """CPUs of the trainer worker."""
    rollout_gpus: float = Field(0.0, ge=0)
    """GPUs per rollout worker."""
    trainer_gpus: float = Field(0.0, ge=0)
    """GPUs of the trainer worker."""
    rollout_resources: dict[str, float] = Field(default_factory=dict)
    """`ray`: Ray custom resources each rollout replica asks for, which places replicas on the nodes that offer
    them, e.g. `{rollout_node: 1}` with nodes started by `ray start --address=HEAD --resources='{"rollout_node":
    4}'` (docs/cluster.md)."""
    trainer_resources: dict[str, float] = Field(default_factory=dict)
    """`ray` with `train.engine: fsdp2`: Ray custom resources each training rank asks for (places the ranks)."""
    weight_sync: Literal["inprocess", "shared_memory", "ray", "torch_distributed"] = "shared_memory"
    """How new weights reach Ray rollout replicas: `shared_memory` (one machine), `ray` (object store, any
    cluster), `torch_distributed` (gloo on CPU, NCCL on GPU). The inline runtime always uses `inprocess`."""
    storage_units: int = Field(1, ge=1)
    """TransferQueue storage units (rows are sharded across them); each is a Ray actor under `ray`. One unit sits
    on the driver's node with the controller; more are spread over the cluster's nodes (the bytes of a large
    cluster); on one machine each extra unit adds a round trip per call."""
    lend_idle_cores: bool = True
    """`ray` on a local CPU cluster: the trainer runs torch on the replicas' cores while they wait for weights
    (`asyncflow.runtime.cores`); `false` keeps each worker on its own CPUs. The thread count of a micro-batch
    then depends on timing, and with it the float summation order: turn it off for bit-identical reruns."""
    call_timeout_s: float = Field(600.0, gt=0)
    """Timeout of every remote call and weight sync."""
    start_timeout_s: float = Field(900.0, gt=0)
    """`ray`: how long a rollout replica may take to start (its imports, model load and engine start: a vLLM
    engine on a busy CPU takes minutes), when the run places it and after a restart; calls to it after that are
    bounded by `call_timeout_s`."""
    max_restarts: int = Field(2, ge=0)
    """`ray`: times a dead rollout replica is restarted (its unfinished rows are generated again)."""


class WeightsConfig(Section):
    """How weight versions travel from the trainer to the rollout replicas (docs/weight-updates.md)."""

    delta: bool = False
    """Lossless delta updates: a replica holding the previous version receives only the elements whose bits
    changed in the rollout engine's dtype (`rollout.dtype`), bit-exact with a full update; a full version when the
    delta is larger than `delta_max_fraction` of it, at a replica's first version, after it skipped one, after a
    restart and after a resume. Every `runtime.weight_sync` (docs/weight-updates.md)."""
    delta_max_fraction: float = Field(0.1, gt=0, le=1)
    """A delta larger than this fraction of the full version's bytes (in the engine's dtype) is not sent: the full
    version is. The default is where a delta stopped winning on one host (BENCHMARKS.md, bench_weight_updates: ahead
    at 7% of the bytes, behind at 20%); where versions cross a network a larger one pays."""
    stage_on_driver: bool = True
    """`true`: the driver stages each version whole in the rollout dtype and sends it in the background, so the
    trainer steps on while the replicas take it (the async overlap); `false` (`runtime.weight_sync:
    torch_distributed` with `train.engine: fsdp2`): the driver forwards the ranks' stream to the replicas one bucket
    at a time and never holds a version, but each publish waits until every replica took it."""
    publish_timeout_s: float | None = Field(None, gt=0)
    """Deadline of the trainer's side of a version: its publish and the wait for it to reach the replicas;
    `null`: `runtime.call_timeout_s`."""
    receive_timeout_s: float | None = Field(None, gt=0)
    """Deadline of a replica's wait for a version it needs (the staleness bound) and of each transfer;
    `null`: `runtime.call_timeout_s`."""
    apply_timeout_s: float | None = Field(None, gt=0)
    """Deadline of an engine taking a version (pause, reload, resume); what a missed one does is
    `on_apply_deadline`; `null`: `runtime.call_timeout_s`."""
    on_apply_deadline: Literal["fail", "restart"] = "fail"
    """A replica whose engine missed `apply_timeout_s`: `fail` ends the run with an error naming the replica, the
    version and the phase; `restart` (`runtime.kind: ray`) ends the replica's process, which Ray restarts as after
    a crash (its unfinished rows generated again, up to `runtime.max_restarts`; a replica of `runtime.weight_sync:
    torch_distributed` cannot rejoin its group, so the run then ends naming it)."""

    def deadline(self, phase: str, call_timeout_s: float) -> float:
        """The deadline in seconds of `phase` ("publish", "receive" or "apply")."""
        value = getattr(self, f"{phase}_timeout_s")
        return call_timeout_s if value is None else value


class ObserveConfig(Section):
    tensorboard: bool = True
    """Write TensorBoard event files to `RUN_DIR/tensorboard/`."""
    wandb: bool = False
    """Also log every metric of metrics.jsonl (same names and steps) and the resolved config to Weights &
    Biases. Needs the `wandb` extra (`pip install 'asyncflow-rl[wandb]'`); without it the config is
    rejected before any work."""
    wandb_project: str = "asyncflow"
    """W&B project."""
    wandb_entity: str | None = None
    """W&B entity (user or team); `null` = your default entity."""
    wandb_name: str | None = None
    """Name of the W&B run; `null` = `run.name`."""
    wandb_mode: Literal["online", "offline"] = "offline"
    """`offline`: the W&B run is written to `RUN_DIR/wandb/` with no account or network (upload it later
    with `wandb sync RUN_DIR/wandb/offline-run-*`); `online`: streamed to the W&B server (needs `wandb
    login`). `WANDB_MODE` in the environment takes precedence; `WANDB_DIR` moves the folder."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Serve the run's live Prometheus metrics at `http://metrics_host:PORT/metrics` while it trains: every scalar
    of the last logged step (`asyncflow_` + its name with `/` as `_`, e.g. `asyncflow_throughput_tokens_per_s`)
    and, read at each scrape, the step, the queue's rows by column and state, each worker's idle fraction and each
    replica's weight version. `0` takes a free port, logged and written to `RUN_DIR/metrics_port`; `null` = off."""
    metrics_host: str = "127.0.0.1"
    """The address `/metrics` listens on (`0.0.0.0` to be scraped from other machines)."""
    stall_s: float | None = Field(600.0, gt=0)
    """The watchdog: when no step has ended and no queue row was written or consumed for this many seconds, log
    which stage waits on which and the stack of every driver thread (see `stall_action`); `null` = off."""
    stall_action: Literal["log", "stop"] = "log"
    """What a stall does after it is logged: `log` only, or `stop` the run with an error naming the stalled stage
    (the folder stays resumable from its last checkpoint)."""

    @field_validator("wandb")
    @classmethod
    def _wandb_installed(cls, value: bool) -> bool:
        if value:
            from asyncflow.observe.wandb_logger import require_wandb

            try:
                require_wandb()
            except ModuleNotFoundError as err:
                raise ValueError(f"{err} (or set observe.wandb=false)") from None
        return value

    def wandb_run(self, config: Config) -> dict[str, Any] | None:
        """Keyword arguments of `asyncflow.observe.wandb_logger.WandbWriter` for the run of `config`
        (passed as `MetricsLogger(wandb=...)`); None when `wandb` is off."""
        if not self.wandb:
            return None
        return {
            "project": self.wandb_project, "entity": self.wandb_entity, "name": self.wandb_name or config.run.name,
            "mode": self.wandb_mode, "config": config.model_dump(mode="json"),
        }


class StageConfig(Section):
    """A user stage over the TransferQueue (`asyncflow.workers.stage`): it reads `inputs` of each row as soon as
    they are ready and writes `outputs` back, from a thread of the driver, in every workflow and runtime."""

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Its consumer name on the queue (and on the timeline); not a built-in task (rollout, reward, train)."""
    fn: str
    """`package.module:function`, called with a `StageBatch`, returning `{output: [one float per row]}`."""
    inputs: list[str] = Field(default_factory=lambda: ["prompt_ids", "response_ids"], min_length=1)
    """Columns it reads (`prompt_ids`, `response_ids`, `rollout_logprobs`, `reward`, another stage's outputs)."""
    outputs: list[str] = Field(min_length=1)
    """Per-row scalar columns it writes."""
    batch_size: int = Field(16, ge=1)
    """Rows per call."""


class AgentConfig(Section):
    fn: str | None = None
    """An agent written against the `openai` client, as `package.module:function`, called `fn(client, row)` once
    per sample (`asyncflow.workers.agent`): `client` is an `openai.OpenAI` bound to this run's server for that
    episode, `row` an `AgentRow` (prompt, answer, metadata, model). It returns the reward (a number), its
    final answer (a string, scored by `reward.fns`) or `{"reward": number, "scores": {name: number}}` (scores
    logged as `agent/scores/<name>`). `null` = the built-in single-turn rollout. Any
    `workflow.mode`, inline or on Ray (each rollout replica serves its agents' calls); needs the `serve` extra.
    With `env.name` also set, the environment gives `sft.before_rl` its demonstrations and the held-out evaluation its
    greedy episodes, on prompts rendered as the server renders the agent's first call (`fn.tools`, if the function
    has that attribute, handed to the chat template; docs/multiturn.md)."""
    concurrency: int | None = Field(None, ge=1)
    """Episodes in flight (threads), each waiting on its calls to the server; `null` = `rollout.max_batch_size`.
    Also a `verifiers:` environment's episodes (`env.name`)."""
    episode_timeout_s: float = Field(300.0, gt=0)
    """An episode still running after this many seconds is closed (its later calls are refused) and scores 0,
    counted in `agent/errors`; also each call's HTTP timeout."""
    chat_template: str | None = None
    """A Jinja chat template file for `/v1/chat/completions` when the tokenizer has none (`null`: the
    tokenizer's own); also what renders a `verifiers:` environment's prompts (`env.name`)."""


#: Keys that moved, by their old dotted spelling: a config that still uses one is refused with the new one.
MOVED_KEYS = {
    "rollout.gpu_memory_fraction": "rollout.vllm.gpu_memory_fraction",
    "rollout.kv_cache_gb": "rollout.vllm.kv_cache_gb",
    "rollout.vllm_weight_transfer": "rollout.vllm.weight_transfer",
    "algo.clip_low": "algo.loss.clip_low (with algo.loss: ppo)",
    "algo.clip_high": "algo.loss.clip_high (with algo.loss: ppo)",
    "algo.gspo_clip_low": "algo.loss.clip_low (with algo.loss: gspo)",
    "algo.gspo_clip_high": "algo.loss.clip_high (with algo.loss: gspo)",
    "algo.cispo_clip_low": "algo.loss.clip_low (with algo.loss: cispo)",
    "algo.cispo_clip_high": "algo.loss.clip_high (with algo.loss: cispo)",
    "algo.value_clip": "algo.critic.value_clip",
    "algo.value_coef": "algo.critic.value_coef",
    "algo.tis_cap": "algo.mismatch_correction: token_tis with algo.mismatch_threshold",
}


class Config(Section):
    """A run's whole configuration, one section per part (`run`, `model`, `data`, `rollout`, `algo`, `train` ...);
    built from YAML and dotted overrides by `load_config` / `build_config`, every field documented."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    workflow: WorkflowConfig = Field(default_factory=WorkflowConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    observe: ObserveConfig = Field(default_factory=ObserveConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    stages: list[StageConfig] = Field(default_factory=list)
    """User stages (`asyncflow.workers.stage`), run between rollout and training."""

    @model_validator(mode="before")
    @classmethod
    def _no_moved_keys(cls, data: Any) -> Any:
        for old, new in MOVED_KEYS.items():
            section, key = old.split(".")
            if isinstance(data, dict) and isinstance(data.get(section), dict) and key in data[section]:
                raise ValueError(f"{old} has moved: write {new}")
        return data

    @model_validator(mode="after")
    def _check_weights(self) -> Config:
        if not self.weights.stage_on_driver:
            if self.runtime.kind != "ray" or self.runtime.weight_sync != "torch_distributed":
                raise ValueError("weights.stage_on_driver: false needs runtime.kind: ray with runtime.weight_sync: "
                                 "torch_distributed (the transport that forwards a version bucket by bucket)")
            if self.weights.delta:
                raise ValueError("weights.stage_on_driver: false cannot send deltas (weights.delta: true): a delta is "
                                 "computed against the version the driver staged")
        if self.weights.on_apply_deadline == "restart" and self.runtime.kind != "ray":
            raise ValueError("weights.on_apply_deadline: restart needs runtime.kind: ray (a replica in the trainer's "
                             "process cannot be restarted alone)")
        return self

    @model_validator(mode="after")
    def _check_cross_fields(self) -> Config:
        if self.verifiers_env:
            # data.task at its default is left alone (a saved config repeats it); another task would be ignored
            given = [k for k in ("task", "path", "test_path")
                     if getattr(self.data, k) not in (None, DataConfig.model_fields[k].default)]
            if given:
                raise ValueError(f"env.name={self.env.name}: the environment's dataset is the data; leave "
                                 f"data.{given[0]} unset")
            if self.agent.fn is not None:
                raise ValueError(f"env.name={self.env.name} runs its own episodes: leave agent.fn unset")
            if self.sft.before_rl:
                raise ValueError(f"env.name={self.env.name}: sft.before_rl has no demonstrations of a verifiers "
                                 "environment to train on")
        elif self.data.task is None and self.data.path is None:
            raise ValueError("data.task is null and data.path is not set: give a built-in task or a data file")
        if self.env.options and not self.verifiers_env:
            raise ValueError("env.options are the load_environment arguments of a verifiers:... environment")
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names) or set(names) & {"rollout", "reward", "train"}:
            raise ValueError(f"stages: names must be distinct and not rollout, reward or train: {names}")
        written = {c for s in self.stages for c in s.outputs}
        for column in self.reward.columns:
            if column not in written:
                raise ValueError(f"reward.columns: {column!r} is written by no stage (stages write {sorted(written)})")
        if self.reward.weights is not None and len(self.reward.weights) != len(self.reward.fns):
            raise ValueError(
                f"reward.weights has {len(self.reward.weights)} entries but reward.fns has {len(self.reward.fns)}"
            )
        if self.train.precision == "bf16" and self.model.dtype != "float32":
            raise ValueError(
                f"train.precision=bf16 keeps float32 master weights: set model.dtype=float32 (got {self.model.dtype}; "
                "train.precision=fp32 with model.dtype=bfloat16 trains pure bf16 weights)"
            )
        if self.agent_rollouts and self.rollout.on_weight_update == "resume":
            what = "agent.fn" if self.agent.fn is not None else f"env.name={self.env.name}"
            raise ValueError(
                f"{what} with rollout.on_weight_update=resume: an agent's calls are sampled with the weights of their "
                "partition only; use on_weight_update=finish"
            )
        return self

    @model_validator(mode="after")
    def _router_replay_rollouts(self) -> Config:
        """`algo.router_replay` needs rollouts whose engine records its routing into the rows."""
        if not self.algo.router_replay:
            return self
        if self.rollout.engine != "torch":
            raise ValueError(
                f"algo.router_replay with rollout.engine={self.rollout.engine}: only the built-in torch engine records "
                "its routing (vLLM returns it only with its V2 model runner, which its CPU build cannot run); set "
                "rollout.engine=torch or algo.router_replay=false"
            )
        if self.env.name is not None or self.agent.fn is not None:
            what = "agent.fn" if self.agent.fn is not None else f"env.name={self.env.name}"
            raise ValueError(f"algo.router_replay with {what}: routing is recorded for single-turn rollouts only")
        return self

    @model_validator(mode="after")
    def _lora_adapter_sync_engine(self) -> Config:
        """`train.lora.sync=adapter` needs a rollout engine that applies adapters."""
        if self.train.lora.rank and self.train.lora.sync == "adapter" and self.rollout.engine not in ADAPTER_ENGINES:
            raise ValueError(
                f"train.lora.sync=adapter: rollout.engine {self.rollout.engine!r} takes no LoRA adapters (only "
                f"{', '.join(ADAPTER_ENGINES)} do); set train.lora.sync=merged to send it the merged weights"
            )
        return self

    @property
    def verifiers_env(self) -> bool:
        """`env.name` is a `verifiers:` environment."""
        return self.env.name is not None and self.env.name.startswith("verifiers:")

    @property
    def agent_rollouts(self) -> bool:
        """Rollouts are agent episodes through the run's server (`agent.fn`, or a `verifiers:` environment)."""
        return self.agent.fn is not None or self.verifiers_env

    def rollout_dtype(self) -> str:
        """The dtype of the rollout engines' weights: `rollout.dtype`, or for `auto` bfloat16 under
        `train.precision: bf16` and `model.dtype` otherwise."""
        if self.rollout.dtype != "auto":
            return self.rollout.dtype
        return "bfloat16" if self.train.precision == "bf16" else self.model.dtype


class ConfigError(ValueError):
    """The config file or an override is invalid; the message names the key."""


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if isinstance(child, str):  # a variant by name (`algo.loss=gspo`), then one of its keys
            child = node[key] = {"kind": child}
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {'.'.join(keys[: i + 1])} is not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> dict:
    """`["train.lr=3e-4", "data.task=null"]` -> nested dict; values parsed as YAML scalars/lists."""
    tree: dict = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({err.problem})") from None
        _set_dotted(tree, key.strip(), value)
    return tree


def _merge(base: dict, extra: dict) -> dict:
    """`extra` over `base`, section by section. A variant given by name in `base` (`algo.loss: gspo`) that `extra`
    sets keys of (`algo.loss.clip_high=...`) is `{kind: NAME}` under those keys."""
    out = dict(base)
    for key, value in extra.items():
        below = out.get(key)
        if isinstance(value, dict) and isinstance(below, str):
            below = {"kind": below}
        out[key] = _merge(below, value) if isinstance(value, dict) and isinstance(below, dict) else value
    return out


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(root)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        elif e["type"] == "union_tag_invalid":  # a variant's kind
            lines.append(f"  {key}: {e['ctx']['tag']!r} is not one of {e['ctx']['expected_tags']}")
        elif e["type"] == "union_tag_not_found":  # a mapping without its kind
            lines.append(f"  {key}: a mapping here needs its `kind`")
        elif e["type"] == "value_error":  # a validator's message, which says what it got
            lines.append(f"  {key}: {e['msg'].removeprefix('Value error, ')}")
        else:
            got = "" if e["type"] == "missing" else f" (got {e.get('input')!r})"
            lines.append(f"  {key}: {e['msg']}{got}")
    return "invalid config:\n" + "\n".join(lines)


def build_config(data: dict, overrides: list[str] | None = None) -> Config:
    """A validated `Config` from a nested dict (YAML's shape) and dotted overrides (`"train.lr=3e-4"`); a bad
    key or value raises `ConfigError` naming it."""
    try:
        return Config.model_validate(_merge(data, parse_overrides(overrides or [])))
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or defaults when `path` is None) and apply dotted overrides."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    return build_config(data, overrides)


def dump_config(config: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
