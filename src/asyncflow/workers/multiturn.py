"""Multi-turn, tool-using rollouts that keep token ids end to end.

Owns: `TurnTemplate` (the token ids appended between turns), `Episode` (one transcript as ids, with its
loss mask, sampling log-probs and weight versions), `EpisodeRunner` (one episode: model turn, environment
step, observation ids, ...), `MultiTurnSpec` (the plain settings a process needs to build the rollout),
`MultiTurnRolloutWorker` (a partition's rows as concurrent episodes over one `EngineService`) and
`make_rollout_worker`.

Token ids: a turn's prompt is the previous prompt plus the ids appended since, never a re-tokenized
transcript. The model's sampled ids go in as sampled (its stop token included), loss mask 1, with their
sampling log-probs and weight version. An observation goes in as ids rendered from the tokenizer's own
chat template where it has one: the pieces around a tool message (and the next generation prompt) are
rendered once, with a placeholder for the content, and tokenized once (`TurnTemplate.from_tokenizer`);
per turn only the observation text is tokenized and placed between them; loss mask 0, log-prob 0.
Without a chat template an observation is `<tool_response>TEXT</tool_response>` in plain text.

Invariants:
- `Episode.response_ids` is exactly the concatenation, in order, of each turn's sampled ids and each
  observation's appended ids; `loss_mask` is 1 exactly on the sampled ids.
- The trained ids are the sampled ones: `count_retokenize_drift` (the sampled ids of each turn against the
  row's ids under loss mask 1) is 0 for every episode, recorded in the row's metadata.
- A transcript never exceeds `max_context_tokens`: a turn's token budget is what is left of it; a turn
  cut by that budget or by `max_new_tokens`, an observation that would not fit, or `max_turns` model turns
  without a final answer end the episode with finish reason "length" and reward 0.
- Episodes of a partition share one engine through `EngineService` (continuous batching across turns);
  environment steps and tool calls run on the episodes' pool threads, never on the engine's thread.
- The weights change only between partitions (the service is opened per partition), so every token of a
  row carries the row's weight version.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any

from asyncflow.data.prompts import Prompt
from asyncflow.engines.base import Completion, InferenceEngine, SamplingParams, Transcript
from asyncflow.engines.service import EngineService
from asyncflow.envs import Environment, SandboxLimits, ToolBox, make_environment
from asyncflow.envs.builtin import COUNTERS
from asyncflow.rewards import CompositeReward
from asyncflow.rewards.contract import RewardFn
from asyncflow.workers.rollout import FinishedRow, GeneratingRole, Rollout, RolloutWorker, RowWriter

log = logging.getLogger(__name__)

PLACEHOLDER = "\x00OBSERVATION\x00"
Generate = Callable[[list[int], SamplingParams], Completion]


@dataclass(frozen=True)
class TurnTemplate:
    """Ids appended after a model turn that did not finish the episode: `before + ids(observation) + after`."""

    before: tuple[int, ...]
    after: tuple[int, ...]

    def observation_ids(self, tokenizer, text: str) -> list[int]:
        return [*self.before, *tokenizer.encode(text, add_special_tokens=False), *self.after]

    @classmethod
    def from_tokenizer(cls, tokenizer, use_chat_template: bool | None = None) -> TurnTemplate:
        """The tokenizer's chat template around a `tool` message (a `user` message wrapping it in
        `<tool_response>` when the template has no tool role), or plain `<tool_response>` text."""
        if use_chat_template is None:
            use_chat_template = bool(getattr(tokenizer, "chat_template", None))
        before, after = _chat_pieces(tokenizer) if use_chat_template else ("<tool_response>", "</tool_response>")
        return cls(*(tuple(tokenizer.encode(text, add_special_tokens=False)) for text in (before, after)))


def _chat_pieces(tokenizer) -> tuple[str, str]:
    """Template text between the end of an assistant turn (after its stop token) and a tool message's content,
    and from the content to the next assistant turn's first sampled token."""
    base = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    rendered = tokenizer.apply_chat_template(base, tokenize=False)
    end = tokenizer.eos_token or ""
    tail_at = rendered.rfind("A" + end)
    if tail_at < 0:
        raise ValueError("the chat template does not end an assistant turn with the EOS token: cannot tell which "
                         "ids follow a model turn (set model.use_chat_template=false)")
    after_stop = rendered[tail_at + 1 + len(end):]
    for role, content in (("tool", PLACEHOLDER), ("user", f"<tool_response>\n{PLACEHOLDER}\n</tool_response>")):
        try:
            full = tokenizer.apply_chat_template(
                [*base, {"role": role, "content": content}], tokenize=False, add_generation_prompt=True
            )
        except Exception:  # noqa: BLE001 -- templates without a tool role raise; try the next form
            continue
        if full.startswith(rendered) and full.count(PLACEHOLDER) == 1:
            before, after = full[len(rendered):].split(PLACEHOLDER)
            return after_stop + before, after
    raise ValueError("the chat template renders neither a tool message nor a user message after an assistant turn")


@dataclass
class Episode(Transcript):
    turns: int = 0
    finish_reason: str = "stop"
    reward: float = 0.0
    info: dict[str, float] = field(default_factory=dict)
    weight_version: int = 0  # of its latest turn (weights change between partitions, so of every turn)
    sampled: list[list[int]] = field(default_factory=list)  # each turn's ids as the engine returned them


class EpisodeRunner:
    """Runs one episode given a way to generate a turn (`generate(prompt_ids, params) -> Completion`)."""

    def __init__(self, tokenizer, template: TurnTemplate, make_env: Callable[[], Environment],
                 params: SamplingParams, *, max_turns: int, max_context_tokens: int):
        self.tokenizer = tokenizer
        self.template = template
        self.make_env = make_env
        self.params = params
        self.max_turns = max_turns
        self.max_context_tokens = max_context_tokens

    def run(self, generate: Generate, prompt_ids: list[int], row: dict[str, Any],
            params: SamplingParams | None = None) -> Episode:
        params = params or self.params
        episode = Episode(list(prompt_ids))
        env = self.make_env()
        try:
            env.reset(row)
        except Exception as err:  # noqa: BLE001 - an environment's failure fails its episode, never the rollout
            return self._failed(episode, "reset", err)
        for _ in range(self.max_turns):
            budget = self.max_context_tokens - len(prompt_ids) - len(episode.response_ids)
            if budget <= 0:
                return self._cut(episode)
            turn_params = replace(params, max_new_tokens=min(params.max_new_tokens, budget))
            completion = generate(episode.prompt_ids + episode.response_ids, turn_params)
            episode.sampled.append(list(completion.response_ids))
            episode.add_sampled(completion.response_ids, completion.logprobs, completion.weight_version)
            episode.weight_version = completion.weight_version
            episode.turns += 1
            if completion.finish_reason == "length":
                return self._cut(episode)
            try:
                result = env.step(self.tokenizer.decode(completion.response_ids, skip_special_tokens=True))
            except Exception as err:  # noqa: BLE001 - see reset
                return self._failed(episode, "step", err)
            episode.info = dict(result.info)
            if result.done:
                episode.reward = float(result.reward)
                return episode
            observation = self.template.observation_ids(self.tokenizer, result.observation or "")
            if len(prompt_ids) + len(episode.response_ids) + len(observation) >= self.max_context_tokens:
                return self._cut(episode)
            episode.add_appended(observation, episode.weight_version)
        return self._cut(episode)

    @staticmethod
    def _failed(episode: Episode, where: str, err: Exception) -> Episode:
        """The environment raised: the episode ends, scored 0 and counted (`env/env_errors`)."""
        log.warning("environment %s failed: %r (episode scored 0)", where, err)
        episode.finish_reason = "error"
        episode.reward = 0.0
        episode.info = {**episode.info, "env_errors": 1}
        return episode

    @staticmethod
    def _cut(episode: Episode) -> Episode:
        episode.finish_reason = "length"
        episode.reward = 0.0
        return episode

    def demonstration(self, prompt_ids: list[int], row: dict[str, Any], turns: list[str]) -> Episode:
        """The episode in which the model writes `turns` (each followed by EOS): SFT on tool-use
        demonstrations trains on exactly the ids a rollout would have sampled and appended."""
        script = iter(turns)
        eos = self.tokenizer.eos_token_id

        def scripted(ids: list[int], params: SamplingParams) -> Completion:
            text = next(script, None)
            if text is None:
                raise ValueError(f"the demonstration {turns!r} ends before its episode does")
            response = self.tokenizer.encode(text, add_special_tokens=False) + [eos]
            return Completion(None, ids, response, [0.0] * len(response), "stop", 0)

        return self.run(scripted, prompt_ids, row, replace(self.params, max_new_tokens=self.max_context_tokens))


@dataclass(frozen=True)
class MultiTurnSpec:
    """Plain settings of a multi-turn rollout (travels to a Ray actor); `build` makes the `EpisodeRunner`."""

    env: str
    reward_specs: tuple[tuple[str | RewardFn, float], ...]
    max_turns: int
    max_context_tokens: int
    concurrency: int
    tool_timeout_s: float
    tool_workers: int
    max_tool_output_chars: int
    sandbox: SandboxLimits
    use_chat_template: bool | None = None
    turn_timeout_s: float = 600.0

    def build(self, tokenizer, params: SamplingParams) -> EpisodeRunner:
        toolbox = ToolBox(timeout_s=self.tool_timeout_s, max_output_chars=self.max_tool_output_chars,
                          workers=self.tool_workers, limits=self.sandbox)
        reward = CompositeReward(list(self.reward_specs))

        def verifier(text: str, row: dict[str, Any]) -> float:
            extra = {k: v for k, v in row.items() if k != "answer"}
            try:
                return reward(text, row["answer"], **extra)
            except Exception:  # noqa: BLE001 -- a failing reward scores 0, like the reward worker's
                log.warning("reward failed on a final answer", exc_info=True)
                return 0.0

        def make_env() -> Environment:
            return make_environment(self.env, toolbox=toolbox, verifier=verifier)

        template = TurnTemplate.from_tokenizer(tokenizer, self.use_chat_template)
        return EpisodeRunner(tokenizer, template, make_env, params, max_turns=self.max_turns,
                             max_context_tokens=self.max_context_tokens)


def episode_metadata(episode: Episode) -> dict[str, Any]:
    """What a row's metadata records of its episode (read back by the step metrics)."""
    return {"finish_reason": episode.finish_reason, "turns": episode.turns,
            "retokenize_drift_tokens": episode.count_retokenize_drift(episode.sampled),
            **{f"env/{k}": episode.info.get(k, 0) for k in (*COUNTERS, "env_errors")}}


class MultiTurnRolloutWorker:
    """`RolloutWorker`'s role for multi-turn episodes: rows of a partition become episodes run `concurrency` at a
    time on a thread pool, every turn generated by one `EngineService` over `engine`; each finished row is
    written with its reward (the environment scores it), so no reward worker reads these partitions."""

    scores_rows = True

    def close(self) -> None:
        self.engine.close()

    def __init__(self, engine: InferenceEngine, params: SamplingParams, group_size: int, runner: EpisodeRunner,
                 *, concurrency: int, turn_timeout_s: float = 600.0):
        self.engine = engine
        self.params = params
        self.group_size = group_size
        self.runner = runner
        self.concurrency = concurrency
        self.turn_timeout_s = turn_timeout_s

    def _episodes(self, items: Iterable[tuple[Any, list[int], dict]]) -> Iterator[tuple[Any, Episode]]:
        """(key, prompt ids, row) -> (key, episode) in completion order, at most `concurrency` in flight."""
        service = EngineService(self.engine, self.params, name="multiturn-engine")

        def generate(ids: list[int], params: SamplingParams) -> Completion:
            return service.generate(ids, params, timeout=self.turn_timeout_s)

        running: dict[Future, Any] = {}
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="episode")
        try:
            for key, prompt_ids, row in items:
                while len(running) >= self.concurrency:
                    yield from self._collect(running, FIRST_COMPLETED)
                running[pool.submit(self.runner.run, generate, prompt_ids, row)] = key
                yield from self._collect(running, None)
            while running:
                yield from self._collect(running, FIRST_COMPLETED)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            service.close()

    def _collect(self, running: dict[Future, Any], block) -> Iterator[tuple[Any, Episode]]:
        done = [f for f in running if f.done()] if block is None else wait(running, return_when=block).done
        for future in done:
            key = running.pop(future)
            yield key, future.result()

    def run_partition(self, queue, partition: str, *, batch_size: int, timeout: float, consumer: str | None = None,
                      scorer=None) -> int:
        """Run an episode per row of `partition` not taken by another replica; write `response_ids`,
        `rollout_logprobs`, `loss_mask` and `reward` through a `RowWriter`. `scorer` is unused: the
        environment scores. Returns rows generated."""
        version = self.engine.weight_version

        def items():
            for batch in queue.loader(partition, "rollout", ["prompt_ids"], min(batch_size, self.concurrency),
                                      timeout=timeout, consumer=consumer):
                yield from zip(batch.meta.indices, (ids.tolist() for ids in batch.rows("prompt_ids")),
                               batch.meta.metadata)

        with RowWriter(queue, partition, group_size=self.group_size) as writer:
            for index, episode in self._episodes(items()):
                writer.add(FinishedRow(index, episode.response_ids, episode.logprobs, version,
                                       episode_metadata(episode), reward=episode.reward, loss_mask=episode.loss_mask))
        return writer.written

    def generate(self, prompts: Iterable[Prompt]) -> Iterator[Rollout]:
        """One scored rollout per (prompt, sample) as its episode finishes (reward set from the environment)."""
        by_group: dict[int, Prompt] = {}

        def items():
            for prompt in prompts:
                by_group[prompt.group_id] = prompt
                row = {"answer": prompt.answer, **prompt.metadata}
                for k in range(self.group_size):
                    yield (prompt.group_id, k), prompt.prompt_ids, {**row, "sample_index": k}

        for (group_id, k), episode in self._episodes(items()):
            prompt = by_group[group_id]
            yield Rollout(
                group_id=group_id, sample_index=k, prompt_ids=prompt.prompt_ids,
                response_ids=episode.response_ids, rollout_logprobs=episode.logprobs,
                finish_reason=episode.finish_reason, weight_version=episode.weight_version, answer=prompt.answer,
                metadata={**prompt.metadata, **episode_metadata(episode)}, reward=episode.reward,
                loss_mask=episode.loss_mask,
            )


def make_rollout_worker(engine: InferenceEngine, params: SamplingParams, group_size: int, *,
                        multiturn: MultiTurnSpec | None = None, tokenizer=None) -> GeneratingRole:
    """A `RolloutWorker` (single-turn), or a `MultiTurnRolloutWorker` when `multiturn` is given."""
    if multiturn is None:
        return RolloutWorker(engine, params, group_size)
    runner = multiturn.build(tokenizer, params)
    return MultiTurnRolloutWorker(engine, params, group_size, runner, concurrency=multiturn.concurrency,
                                  turn_timeout_s=multiturn.turn_timeout_s)
