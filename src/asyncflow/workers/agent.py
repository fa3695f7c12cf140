"""Agent rollouts: a user's agent, written against the `openai` client, generates a partition's rows through the
OpenAI-compatible server, and is trained on the token ids the server recorded for its calls.

Owns: `AgentRow` (what the agent is given), `resolve_agent` (`package.module:function` -> the function) and
`AgentRolloutWorker`, a rollout worker with `RolloutWorker.run_partition`'s contract. For each row it opens
an episode on the server, calls `agent(client, row)` on a pool thread with an `openai.OpenAI` client whose
base URL is `.../episodes/<episode id>/v1` (the episode id travels in the URL path, so any HTTP client works
as well), closes the episode and turns its calls into the training row (`asyncflow.serving.episodes`):
prompt = the first call's prompt ids; then each call's new context (loss mask 0) and sampled ids (mask 1).
A call that does not extend the row's context (the agent rewrote its history) ends the row: it and later
calls are not trained, and are counted (`agent/dropped_calls`).

Rewards: the agent returns a number (the reward), a string (its final answer, scored by the run's reward
functions against the row's answer) or `{"reward": number, "scores": {name: number}}` (the scores are kept in
the row's metadata, `agent_scores`, and logged as metrics `agent/scores/<name>`). An agent that raises, returns
anything else or runs past `episode_timeout_s` scores 0 (`agent/errors`); an episode without a call trains
nothing (one placeholder token with loss mask 0, so the group keeps its size).

`agent` is a spec (`agent.fn`) or a callable object, such as the `verifiers:` environments' `VerifiersAgent`
(`asyncflow.envs.verifiers_env`); an object with a `prepare()` method has it called once where the worker is
built.

Invariants:
- Every trained token (loss mask 1) is a token the engine sampled for one of the episode's calls, with its
  sampling log-prob; its weight version is the row's (weights change only between partitions: the engine
  service is opened per partition, and episode calls sample with the rollout's temperature / top-p / top-k).
- Each row is written once, with its reward, in the same queue write as its response.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncflow.engines.base import InferenceEngine, SamplingParams
from asyncflow.engines.service import EngineService
from asyncflow.serving.episodes import EpisodeRecorder, EpisodeRow, episode_row
from asyncflow.workers.rollout import FinishedRow, RowWriter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentRow:
    """One sample for the agent: the task's prompt text and answer, its metadata, and the model name to ask for."""

    prompt: str
    answer: str
    model: str
    episode_id: str
    metadata: dict = field(default_factory=dict)


def resolve_agent(spec: str) -> Callable[[Any, AgentRow], Any]:
    """`package.module:function` or `path/to/file.py:function` -> the function; a clear error naming `agent.fn`
    otherwise."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"agent.fn={spec!r}: expected 'package.module:function' or 'path/to/file.py:function'")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            loader = importlib.util.spec_from_file_location(f"asyncflow_agent_{path.stem}", path)
            if loader is None or loader.loader is None or not path.is_file():
                raise ImportError(f"no such file {module_name!r}")
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        fn = getattr(module, attr)
    except (ImportError, AttributeError, SyntaxError) as err:
        raise ValueError(f"agent.fn={spec!r}: cannot be imported ({err})") from None
    if not callable(fn):
        raise ValueError(f"agent.fn={spec!r}: not callable")
    return fn


def absolute_agent_spec(spec: str) -> str:
    """`path/to/file.py:function` with the path made absolute (a Ray actor's working directory is not the
    driver's); `package.module:function` unchanged."""
    module_name, sep, attr = spec.rpartition(":")
    if sep and module_name.endswith(".py"):
        return f"{Path(module_name).resolve()}:{attr}"
    return spec


@dataclass
class _Outcome:
    row: EpisodeRow | None
    reward: float | None = None
    answer: str | None = None
    error: str | None = None
    scores: dict[str, float] | None = None


class _Episode:
    """One episode's result, settled once: by the agent's thread when it returns, or by the driver at timeout."""

    def __init__(self, episode_id: str, index: int, meta: dict, prompt_ids: list[int]):
        self.id, self.index, self.meta, self.prompt_ids = episode_id, index, meta, prompt_ids
        self.started: float | None = None  # when a pool thread took it
        self.done: Future = Future()
        self.lock = threading.Lock()

    def settle(self, recorder: EpisodeRecorder, result: Any = None, error: str | None = None) -> None:
        with self.lock:
            if self.done.done():
                return
            outcome = _Outcome(episode_row(recorder.close(self.id)), error=error)
            if error is None and isinstance(result, dict):
                result, outcome.scores = _scored(result)
                if outcome.scores is None:
                    outcome.error = f"the agent returned {result!r:.60}, not {{'reward': number, 'scores': {{...}}}}"
            if outcome.error is None:
                if isinstance(result, str):
                    outcome.answer = result
                elif isinstance(result, (int, float)) and not isinstance(result, bool) and math.isfinite(result):
                    outcome.reward = float(result)
                else:
                    outcome.error = f"the agent returned {result!r:.60}, not a finite number or a string"
            self.done.set_result(outcome)


def _scored(result: dict) -> tuple[Any, dict[str, float] | None]:
    """`{"reward": x, "scores": {name: number}}` -> (x, scores); (result, None) when it is not that shape."""
    scores = result.get("scores", {})
    if set(result) - {"reward", "scores"} or not isinstance(scores, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for k, v in scores.items()):
        return result, None
    return result.get("reward"), {k: float(v) for k, v in scores.items()}


class AgentRolloutWorker:
    """Rows of a partition generated by `agent` episodes over the served engine; see the module docstring."""

    scores_rows = True  # the reward goes in the same write as the response: no separate reward stage

    def __init__(self, engine: InferenceEngine, params: SamplingParams, group_size: int, *, agent, tokenizer,
                 scorer, model_name: str, max_model_len: int, concurrency: int, episode_timeout_s: float,
                 chat_template: str | None = None, host: str = "127.0.0.1"):
        from asyncflow.serving.api import ServedModel, make_app
        from asyncflow.serving.server import ServerThread

        self.engine = engine
        self.params = params
        self.group_size = group_size
        self.agent = resolve_agent(agent) if isinstance(agent, str) else agent
        if hasattr(self.agent, "prepare"):  # an agent object that loads what it needs where the worker is built
            self.agent.prepare()
        self.tokenizer = tokenizer
        self.scorer = scorer
        self.episode_timeout_s = episode_timeout_s
        self.recorder = EpisodeRecorder()
        self.api_key = uuid.uuid4().hex
        self.served = ServedModel(
            model_name, tokenizer, None, max_model_len, getattr(engine, "vocab_size", len(tokenizer)), chat_template,
            episode_sampling=params,
        )
        self.server = ServerThread(make_app(self.served, api_key=self.api_key, recorder=self.recorder,
                                            request_timeout_s=episode_timeout_s), host=host).start()
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="agent")
        self.client = self._base_client(concurrency)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
        self.server.stop()
        self.engine.close()

    # ---------------------------------------------------------------- episodes
    def _base_client(self, concurrency: int):
        """One client (and connection pool) for every episode: building an `openai.OpenAI` with its own HTTP
        client costs ~0.2 s of CPU (TLS set-up), more than a tiny model's whole episode."""
        import httpx
        import openai

        # Idle connections are dropped before the server's keep-alive (30 s) closes them, so a step that starts
        # after a long training step never sends on a closed connection; a refused connect is retried once (the
        # request never reached the server, so nothing is recorded twice).
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=5)
        http = httpx.Client(timeout=self.episode_timeout_s, transport=httpx.HTTPTransport(retries=1, limits=limits))
        # openai 3 annotates `http_client` as httpx2's client only; it takes an httpx one too (openai>=1.0 here)
        return openai.OpenAI(base_url=f"{self.server.url}/v1", api_key=self.api_key, max_retries=0,
                             timeout=self.episode_timeout_s, http_client=http)  # type: ignore[arg-type]

    def _run(self, episode: _Episode) -> None:
        episode.started = time.monotonic()
        meta = episode.meta
        row = AgentRow(prompt=meta.get("prompt", ""), answer=meta["answer"], model=self.served.name,
                       episode_id=episode.id, metadata=meta)
        try:
            result = self.agent(self.client.with_options(base_url=f"{self.server.url}/episodes/{episode.id}/v1"), row)
        except Exception as err:  # noqa: BLE001 -- the user's agent failing scores 0, never stops the run
            log.warning("agent episode %s failed: %r", episode.id, err)
            episode.settle(self.recorder, error=repr(err))
        else:
            episode.settle(self.recorder, result)

    def run_partition(self, queue, partition: str, *, batch_size: int, timeout: float, consumer: str | None = None,
                      scorer=None) -> int:
        """Run an episode per row of `partition` and write `response_ids`, `rollout_logprobs`, `loss_mask`,
        `trained_prompt_ids` (the first call's prompt) and `reward` through a `RowWriter`. Returns rows written."""
        scorer = scorer or self.scorer
        episodes: list[_Episode] = []
        with EngineService(self.engine, self.params, name="agent-engine") as service, \
                RowWriter(queue, partition, group_size=self.group_size) as writer:
            self.served.service = service
            try:
                for batch in queue.loader(partition, "rollout", ["prompt_ids"], batch_size, timeout=timeout,
                                          consumer=consumer):
                    rows = zip(batch.meta.indices, batch.meta.metadata, batch.rows("prompt_ids"))
                    for index, meta, prompt in rows:
                        episode = _Episode(f"{partition}-{index}-{uuid.uuid4().hex[:8]}", index, meta, prompt.tolist())
                        self.recorder.open(episode.id)
                        episodes.append(episode)
                        self.pool.submit(self._run, episode)
                pending = {e.done: e for e in episodes}
                finished: list[_Episode] = []
                while pending:
                    done, _ = wait(list(pending), timeout=0.5, return_when=FIRST_COMPLETED)
                    finished += [pending.pop(f) for f in done]
                    now = time.monotonic()
                    for episode in list(pending.values()):
                        if episode.started is not None and now - episode.started > self.episode_timeout_s:
                            log.warning("agent episode %s ran past agent.episode_timeout_s=%.0f s: scored 0",
                                        episode.id, self.episode_timeout_s)
                            episode.settle(self.recorder, error="timeout")
                    if len(finished) >= writer.batch or (finished and not pending):
                        for row in self._rows(finished, scorer):
                            writer.add(row)
                        finished = []
            finally:
                self.served.service = None
        return writer.written

    def _rows(self, episodes: list[_Episode], scorer) -> list[FinishedRow]:
        """The episodes' rows, each rewarded by its agent's number or by `scorer` on its final answer."""
        outcomes = [e.done.result() for e in episodes]
        rewards = [o.reward if o.reward is not None else 0.0 for o in outcomes]
        answered = [i for i, o in enumerate(outcomes) if o.answer is not None]
        if answered:
            scores = scorer.score_texts([outcomes[i].answer for i in answered], [episodes[i].meta for i in answered])
            for i, score in zip(answered, scores.tolist()):
                rewards[i] = score
        placeholder = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        rows = []
        for episode, outcome, reward in zip(episodes, outcomes, rewards):
            row = outcome.row
            if row is None or not row.response_ids:  # no call: nothing to train, the group keeps its size
                row = EpisodeRow(episode.prompt_ids, [placeholder], [0.0], [0], [self.engine.weight_version])
            rows.append(FinishedRow(
                episode.index, row.response_ids, row.logprobs, row.weight_version,
                {"finish_reason": row.finish_reason, "agent_calls": row.calls, "agent_dropped_calls": row.dropped_calls,
                 "retokenize_drift_tokens": row.retokenize_drift_tokens,
                 "agent_error": outcome.error, **({"agent_scores": outcome.scores} if outcome.scores else {})},
                reward=reward, loss_mask=row.loss_mask, trained_prompt_ids=row.prompt_ids,
            ))
        return rows
