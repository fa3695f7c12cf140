"""The pieces of a run built from its config: seeding, datasets, prompt encoder, rewards, sampling;
and `preflight`, every check of a command's input that needs only the config.

Owns the translation from `Config` sections to the constructor arguments of the layers below, so
that those layers never read the config themselves. Everything here is a pure function of the
config (and a tokenizer), so a Ray actor can rebuild the same piece in its own process. What differs
between kinds of environment (`verifiers:` or built-in) and of reward (a function or a judge) is asked
of the config's kinds (`asyncflow.workflow.kinds`), never branched on here; where a multi-rank trainer's
ranks run is the runtime's to say (`asyncflow.runtime.factory.rank_launcher`).

Invariant: `preflight` writes nothing and loads no model (a tokenizer at most): `asyncflow train` and
`eval` run it before the run folder is touched, so bad input stops a command in seconds with a
message naming it, never hours into a run or after a model has loaded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from asyncflow.config import Config
from asyncflow.data import DatasetError, Example
from asyncflow.data.prompts import PromptEncoder, PromptSource, TrainSet
from asyncflow.engines.base import SamplingParams, train_engine_loads_policy
from asyncflow.envs.sandbox import SandboxLimits
from asyncflow.models.loading import (
    eos_token_ids,
    load_generation_config,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from asyncflow.models.value import CriticSpec
from asyncflow.rewards import RewardRunner, check_reward_specs
from asyncflow.rewards.contract import RewardFn
from asyncflow.runtime.base import RolloutSpec
from asyncflow.specs import import_callable
from asyncflow.workers.multiturn import MultiTurnSpec
from asyncflow.workers.reward import RewardWorker
from asyncflow.workers.rollout import LOSS_MASK_COLUMN, ROUTED_EXPERTS_COLUMN, TRAINED_PROMPT_COLUMN
from asyncflow.workers.stage import StageWorker
from asyncflow.workflow.kinds import EnvironmentKind, environment_kind, reward_kind

if TYPE_CHECKING:
    from asyncflow.engines.base import LoRASettings


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def datasets(config: Config) -> tuple[TrainSet, list]:
    """The run's training set (seed-ordered) and held-out examples, as its environment kind has them."""
    return environment_kind(config).datasets()


def prompt_encoder(config: Config, tokenizer, env: EnvironmentKind | None = None) -> PromptEncoder:
    """Prompts rendered as the policy sees them (as the environment kind `env`, default the config's, renders
    them); their text is kept in the metadata for an agent or a reward that reads it (a judge)."""
    keep_text = config.agent_rollouts or any(reward_kind(fn).reads_prompt for fn in config.reward.fns)
    render = (env or environment_kind(config)).render(tokenizer)
    return PromptEncoder(render, config.data.max_prompt_tokens, config.data.on_long_prompt, keep_text=keep_text)


def prompt_source(config: Config, tokenizer, train_set: TrainSet, env: EnvironmentKind | None = None) -> PromptSource:
    return PromptSource(train_set, prompt_encoder(config, tokenizer, env))


@dataclass
class RunInputs:
    """What an RL run is built from besides its engines and runtime (`run_inputs`)."""

    spec: RolloutSpec
    """Its rollout replicas (placed by the runtime)."""
    rewards: RewardRunner
    """Its reward runner."""
    prompts: PromptSource
    """The training prompts, in seed order."""
    eval_encoder: PromptEncoder
    """The held-out prompts' encoder (its own skip count)."""
    eval_params: SamplingParams
    """Evaluation's greedy sampling."""
    stages: list[StageWorker]
    """The user stages of `stages`."""


def run_inputs(config: Config, model_path, tokenizer, checked: Preflight) -> RunInputs:
    """The `RunInputs` of an RL run of `config` from what `preflight` read of it (its training set and its
    environment kind); `model_path`: the resolved policy folder."""
    env = checked.env
    return RunInputs(rollout_spec(config, model_path, tokenizer, env), build_reward_runner(config, env),
                     prompt_source(config, tokenizer, checked.train_set, env), prompt_encoder(config, tokenizer, env),
                     sampling_params(config, tokenizer, greedy=True), stage_workers(config))


def rollout_spec(config: Config, model_path, tokenizer, env: EnvironmentKind | None = None) -> RolloutSpec:
    """The rollout replicas of `config` (placed by the runtime; `model_path` is the resolved policy folder), with
    the episodes of the environment kind `env` (default the config's)."""
    r = config.rollout
    env = env or environment_kind(config)
    return RolloutSpec(
        model_path=str(model_path), dtype=config.rollout_dtype(), device=config.model.device, engine=r.engine,
        engine_options=r.factory_options(config.runtime), max_batch_size=r.max_batch_size,
        params=sampling_params(config, tokenizer, model_path=model_path),
        group_size=r.group_size, seed=config.run.seed, on_weight_update=r.on_weight_update,
        multiturn=multiturn_spec(config, env), agent=agent_options(config, model_path, tokenizer, env),
        make_scorer=partial(make_reward_worker, config), record_routing=config.algo.router_replay,
        **adapter_sync(config),
    )


def adapter_sync(config: Config) -> dict:
    """The `RolloutSpec` fields of LoRA adapter sync (`train.lora.sync: adapter`; {} otherwise)."""
    if config.train.lora.sync != "adapter":
        return {}
    lora = lora_settings(config)
    if lora is None:
        return {}
    return {"adapter": lora, "adapter_slots": config.workflow.max_staleness + 1}


def row_columns(spec: RolloutSpec) -> list[str]:
    """The optional per-row columns the trainer reads of `spec`'s rows."""
    trained_prompt = [TRAINED_PROMPT_COLUMN] if spec.trains_own_prompt else []
    routed = [ROUTED_EXPERTS_COLUMN] if spec.record_routing else []
    return ([LOSS_MASK_COLUMN] if spec.scores_rows else []) + trained_prompt + routed


def agent_options(config: Config, model_path, tokenizer, env: EnvironmentKind | None = None) -> dict | None:
    """The `AgentRolloutWorker` options of an agent's rollouts (`agent.fn`, or the agent of the environment kind
    `env`, default the config's); None without one."""
    a = config.agent
    if not config.agent_rollouts:
        return None
    from transformers import AutoConfig

    agent = (env or environment_kind(config)).agent()
    positions = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", 0)
    return dict(
        agent=agent, model_name=config.run.name or "policy",
        max_model_len=int(positions or tokenizer.model_max_length),
        concurrency=a.concurrency or config.rollout.max_batch_size, episode_timeout_s=a.episode_timeout_s,
        chat_template=Path(a.chat_template).read_text() if a.chat_template else None,
    )


def stage_workers(config: Config) -> list[StageWorker]:
    """The user stages of `stages`, their functions imported (an error names the stage's `fn`)."""
    return [
        StageWorker(s.name, import_callable(s.fn, label=f"stages[{i}].fn", error=ValueError), list(s.inputs),
                    list(s.outputs), s.batch_size)
        for i, s in enumerate(config.stages)
    ]


def lora_settings(config: Config) -> LoRASettings | None:
    """The LoRA settings of `config.train.lora`, or None when `rank` is 0."""
    lora = config.train.lora
    if lora.rank == 0:
        return None
    from asyncflow.engines.base import LoRASettings

    targets = lora.target_modules if isinstance(lora.target_modules, str) else tuple(lora.target_modules)
    return LoRASettings(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, target_modules=targets)


def critic_spec(config: Config, model_path) -> CriticSpec | None:
    """The value model of `config.algo.critic` when `algo.advantage` is `gae` (a separate one's path resolved like
    the policy's; `model_path` when it names none), else None."""
    algo = config.algo
    if algo.advantage != "gae":
        return None
    c = algo.critic
    path = None
    if c.kind == "separate":
        path = str(model_path if c.path is None else resolve_model_path(c.path, seed=config.run.seed))
    return CriticSpec(kind=c.kind, path=path, dtype=config.model.dtype, lr=c.lr or config.train.lr,
                      train_trunk=c.train_trunk)


def train_engine_options(config: Config, model_path, policy: torch.nn.Module | None = None) -> dict:
    """Keyword arguments of `make_train_engine(config.train.engine, ...)`. An engine that trains the policy in this
    process gets it as `model`: `policy`, or the model at `model_path` loaded here. Any other engine also gets
    `world_size`, `model_path`, `dtype`, `timeout_s` and the `launcher` that places its ranks, the runtime's
    (`asyncflow.runtime.factory.rank_launcher`); one whose ranks load the policy themselves
    (`train_engine_loads_policy`: FSDP2) gets the device its ranks use instead of a model, so this process loads
    no copy of the weights."""
    t = config.train
    options: dict[str, Any] = dict(
        lr=t.lr, weight_decay=t.weight_decay, betas=t.betas, grad_clip=t.grad_clip,
        lr_schedule=t.lr_schedule, warmup_steps=t.warmup_steps, total_steps=t.steps,
        use_reference=config.algo.kl_coef > 0, packing=t.packing, precision=t.precision,
        activation_checkpointing=t.activation_checkpointing, critic=critic_spec(config, model_path),
        router_aux_loss_coef=t.router_aux_loss_coef, router_replay=config.algo.router_replay,
    )

    def loaded_policy() -> torch.nn.Module:
        return policy if policy is not None else load_model(model_path, dtype=config.model.dtype,
                                                             device=config.model.device)

    if t.engine == "torch":
        return {**options, "model": loaded_policy(), "lora": lora_settings(config)}
    from asyncflow.runtime.factory import rank_launcher

    options.update(world_size=t.world_size, model_path=str(model_path), dtype=config.model.dtype,
                   timeout_s=config.runtime.call_timeout_s, launcher=rank_launcher(config))
    if train_engine_loads_policy(t.engine):  # FSDP2: its ranks load it
        return {**options, "ranks_device": torch.device(config.model.device).type}
    return {**options, "model": loaded_policy()}


def rl_engine_options(config: Config, model_path, tokenizer) -> dict:
    """Keyword arguments of an RL run's `make_train_engine(config.train.engine, ...)`: `train_engine_options` and
    the teacher's (`teacher_engine_options`)."""
    return {**train_engine_options(config, model_path), **teacher_engine_options(config, tokenizer)}


def teacher_engine_options(config: Config, tokenizer) -> dict:
    """The training engine's teacher for on-policy distillation (`algo.teacher`; {} without one): the loaded model
    (`teacher`) for the torch engine, its folder (`teacher_path`) for FSDP2's ranks. The teacher must share the
    policy's vocabulary (it scores the student's token ids)."""
    ref = config.algo.teacher
    if ref is None:
        return {}
    from asyncflow.workflow.serve import load_served, resolve_model_ref

    options: dict[str, Any]
    if config.train.engine == "torch":
        served = load_served(ref, dtype=config.model.dtype, device=config.model.device)
        options, teacher_tokenizer = {"teacher": served.model}, served.tokenizer
    else:
        resolved = resolve_model_ref(ref)
        if resolved.checkpoint is not None:
            raise ValueError(f"algo.teacher={ref!r} with train.engine={config.train.engine}: its ranks load the "
                             "teacher from a Hugging Face folder or preset; export the checkpoint first")
        options, teacher_tokenizer = {"teacher_path": str(resolved.model_path)}, load_tokenizer(resolved.model_path)
    if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"algo.teacher={ref!r}: its tokenizer differs from the policy's (distillation scores the "
                         "student's token ids with the teacher)")
    return options


def reward_specs(config: Config, env: EnvironmentKind | None = None) -> list[str | RewardFn]:
    """`reward.fns` as the reward runner takes them: `auto` as the environment kind `env` (default the config's)
    scores (the task's verifier, a `verifiers:` environment's rubric), every other entry as its reward kind has it
    (names and specs as written, a judge entry as a `JudgeReward` whose calls end within `reward.timeout_s`)."""
    if config.reward.fns == ["auto"]:
        return (env or environment_kind(config)).auto_rewards()
    return [reward_kind(fn).spec(fn, config) for fn in config.reward.fns]


def weighted_reward_specs(config: Config, env: EnvironmentKind | None = None) -> list[tuple[str | RewardFn, float]]:
    """(`reward_specs`, weight) pairs; `reward.weights` unset weighs each function 1."""
    specs = reward_specs(config, env)
    return list(zip(specs, config.reward.weights or [1.0] * len(specs)))


def build_reward_runner(config: Config, env: EnvironmentKind | None = None) -> RewardRunner:
    """The run's reward runner (`auto` as the environment kind `env`, default the config's, scores); its functions
    are resolved and checked (`check_reward_specs`) when it is built."""
    r = config.reward
    return RewardRunner(weighted_reward_specs(config, env), timeout_s=r.timeout_s, max_workers=r.workers,
                        isolation=r.isolation, max_stuck_calls=r.max_stuck_calls)


def make_reward_worker(config: Config) -> RewardWorker:
    """A reward worker built from config alone (so it can be built in another process)."""
    tokenizer = load_tokenizer(resolve_model_path(config.model.path, seed=config.run.seed))
    return RewardWorker(build_reward_runner(config), tokenizer)


def multiturn_spec(config: Config, kind: EnvironmentKind | None = None) -> MultiTurnSpec | None:
    """The multi-turn rollout settings of `env` for the `multiturn_env` of the environment kind `kind` (default the
    config's; None without one: single-turn rollouts, or agent episodes). The environment's final answers are
    scored by `reward.fns`."""
    env, kind = config.env, kind or environment_kind(config)
    name = kind.multiturn_env()
    if name is None:
        return None
    return MultiTurnSpec(
        env=name, reward_specs=tuple(weighted_reward_specs(config, kind)), max_turns=env.max_turns,
        max_context_tokens=env.max_context_tokens, concurrency=env.concurrency or config.rollout.max_batch_size,
        tool_timeout_s=env.tool_timeout_s, tool_workers=env.tool_workers,
        max_tool_output_chars=env.max_tool_output_chars,
        sandbox=SandboxLimits(timeout_s=env.tool_timeout_s, cpu_s=env.python_cpu_s, memory_mb=env.python_memory_mb,
                              max_output_bytes=env.python_max_output_bytes, isolation=env.python_isolation),
        use_chat_template=config.model.use_chat_template, turn_timeout_s=config.runtime.call_timeout_s,
    )


def sampling_params(config: Config, tokenizer, *, greedy: bool = False, model_path=None) -> SamplingParams:
    """Rollout (or, `greedy`, evaluation) sampling of `config`. A sample stops at the tokenizer's EOS, the EOS ids of
    the generation config of `model_path` (default: the resolved `model.path`) and `rollout.stop_token_ids`."""
    r = config.rollout
    folder = model_path if model_path is not None else resolve_model_path(config.model.path, seed=config.run.seed)
    generation = load_generation_config(folder)
    stop = tuple(dict.fromkeys([*eos_token_ids(tokenizer, generation), *r.stop_token_ids]))
    if greedy:
        return SamplingParams(
            temperature=config.eval.temperature, max_new_tokens=config.eval.max_new_tokens or r.max_new_tokens,
            stop_token_ids=stop,
        )
    return SamplingParams(r.temperature, r.top_p, r.top_k, r.max_new_tokens, stop)


# ---------------------------------------------------------------- preflight
@dataclass
class Preflight:
    """What `preflight` loaded while checking, handed to the run so it is not loaded twice."""

    train_set: TrainSet
    test_set: list[Example]
    env: EnvironmentKind
    """The config's environment kind (also the kind of the config training from its SFT model: a kind reads no
    `model.path`)."""


def preflight(config: Config, *, training: bool = True) -> Preflight:
    """Every check that needs only the config, in the order a user would fix them. `training=False`
    (`asyncflow eval`) checks the held-out prompts only. Raises ValueError subclasses naming the input."""
    # every reward function resolves and takes `(completion, ground_truth, **metadata)`, every weight is finite
    # (and, with `reward.isolation=process`, every function can go to a worker process)
    env = environment_kind(config)
    check_reward_specs(reward_specs(config, env), config.reward.weights, isolation=config.reward.isolation)
    stage_workers(config)  # every stage's function imports
    env.check()  # the environment resolves: an EnvironmentSpecError names env.name
    train_set, test_set = env.datasets()  # read whole: a bad row stops here, named by file, line and field
    if config.agent_rollouts:
        check_agent(config)
    tokenizer = load_tokenizer(resolve_model_path(config.model.path, seed=config.run.seed))
    env.check_tokenizer(tokenizer)
    if config.data.on_long_prompt == "error":
        sets = {"training": train_set.examples if training else [], "held-out": test_set}
        check_prompt_lengths(config, env, tokenizer, sets)
    return Preflight(train_set, test_set, env)


def check_prompt_lengths(config: Config, env: EnvironmentKind, tokenizer, sets: dict[str, list[Example]]) -> None:
    """With `data.on_long_prompt=error`: no prompt of `sets` (name -> examples) is longer than
    `data.max_prompt_tokens` once rendered as the rollout renders it (the lengths of `env`, the config's kind)."""
    limit = config.data.max_prompt_tokens
    for name, examples in sets.items():
        lengths = env.prompt_lengths(tokenizer, [ex.prompt for ex in examples])
        long = [i for i, n in enumerate(lengths) if n > limit]
        if long:
            first = examples[long[0]]
            where = first.source or f"{name} example {long[0]}"
            raise DatasetError(
                f"{len(long)} of {len(examples)} {name} prompts are longer than data.max_prompt_tokens={limit} tokens, "
                f"the first {where} ({first.prompt[:60]!r}, {lengths[long[0]]} tokens): set "
                "data.on_long_prompt=skip to skip them, or raise data.max_prompt_tokens"
            )


def check_agent(config: Config) -> None:
    """`agent.fn` imports and is callable, the `serve` extra and `openai` are installed, the chat template file
    (if any) exists."""
    from asyncflow.workers.agent import resolve_agent

    if config.agent.fn is not None:
        resolve_agent(config.agent.fn)
    what = "agent.fn" if config.agent.fn is not None else f"env.name={config.env.name}"
    for package in ("fastapi", "uvicorn", "openai"):
        try:
            __import__(package)
        except ImportError:
            raise ValueError(f"{what} needs {package!r}: pip install 'asyncflow-rl[serve]' openai") from None
    if config.agent.chat_template is not None and not Path(config.agent.chat_template).is_file():
        raise ValueError(f"agent.chat_template={config.agent.chat_template!r}: no such file")
