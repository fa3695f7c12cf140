"""verifiers environments as asyncflow episodes: `env.name: verifiers:MODULE_OR_ID`.

Owns: `PREFIX`, `load_verifiers_env` (the environment, loaded once per process and options), `verifiers_examples`
(its dataset as plain rows), `render_messages` (a prompt's messages as the server renders them) and
`VerifiersAgent`, the agent (`asyncflow.workers.agent`) that runs one of the environment's rollouts per episode.

What maps onto what:
- The environment is the library's classic `Environment` (`vf.SingleTurnEnv`, `vf.MultiTurnEnv`,
  `vf.ToolEnv` ...) that `load_environment(**env.options)` of MODULE_OR_ID returns: MODULE_OR_ID is an importable
  module, an installed environment's id (the library's own `vf.load_environment`), or `path/to/file.py`.
- Its `dataset` is the training data, row by row: the row's prompt messages (JSON) are the example's prompt,
  its `answer` the answer, and its index travels in the metadata (`verifiers_index`), so an episode starts
  from the library's own row (`prompt`, `answer`, `info`, `example_id` and any other column).
- An episode is the library's `Environment.run_rollout` (its turns, `env_response`, stop conditions, then the
  rubric) with a `vf.OpenAIChatCompletionsClient` over an `openai.AsyncOpenAI` bound to the episode's URL of
  the run's OpenAI-compatible server: every model call is a `/chat/completions` call recorded by the server,
  and the row is trained on the ids it recorded (`asyncflow.serving.episodes`): the first call's prompt, then
  each turn's new context (the environment's messages, loss mask 0) and the ids sampled (loss mask 1). Earlier
  turns are never re-tokenised: the server continues an episode's context from the ids it sampled.
- The reward is the rubric's (`state["reward"]`: the weighted sum of its reward functions); its per-function
  scores come back as the row's `agent_scores` (metrics `agent/scores/<name>`).

Invariants:
- The run's sampling settings (`rollout.temperature`, `top_p`, `top_k`, `max_new_tokens`) decide every call: the
  server forces them on episode calls, whatever the environment asks for.
- The library's rollouts run on one event loop thread per process (`_Loop`); an agent call waits for its
  episode there, so `agent.concurrency` episodes are in flight at once.
- `verifiers` is imported on first use; missing, it is a one-line `VerifiersMissing` naming the extra.
- Loading an environment leaves the process's SIGINT / SIGTERM handlers as they were (the library's
  `Environment` installs its own).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import importlib.util
import json
import logging
import math
import signal
import threading
from pathlib import Path
from typing import Any

from asyncflow.envs.base import EnvironmentSpecError

log = logging.getLogger(__name__)

PREFIX = "verifiers:"
EXTRA = "pip install 'asyncflow-rl[verifiers]'"


class VerifiersMissing(EnvironmentSpecError):
    """`env.name: verifiers:...` without the `verifiers` extra installed."""


def require_verifiers(name: str) -> Any:
    """The `verifiers` package, or a one-line `VerifiersMissing` naming the extra."""
    try:
        import verifiers
        import verifiers.legacy  # noqa: F401 -- the classic Environment / Rubric API
    except ImportError:
        raise VerifiersMissing(f"env.name {name} needs verifiers: {EXTRA}") from None
    return verifiers


def options_json(options: dict[str, Any] | None) -> str:
    try:
        return json.dumps(options or {}, sort_keys=True)
    except TypeError as err:
        raise EnvironmentSpecError(f"env.options must be plain YAML values (they go to load_environment): {err}") \
            from None


@functools.lru_cache(maxsize=8)
def _load(name: str, options: str):
    require_verifiers(name)
    import verifiers as vf
    from verifiers.legacy.envs.environment import Environment

    target = name.removeprefix(PREFIX)
    if not target:
        raise EnvironmentSpecError(f"env.name {name!r}: give verifiers:MODULE_OR_ID")
    kwargs = json.loads(options)
    with _own_signal_handlers():
        try:
            if target.endswith(".py"):
                env = _load_file(name, Path(target), kwargs)
            else:
                env = vf.load_environment(target, **kwargs)
        except EnvironmentSpecError:
            raise
        except Exception as err:  # the library wraps import and load failures in ValueError / RuntimeError
            cause = f" ({err.__cause__!r})" if err.__cause__ is not None else ""
            raise EnvironmentSpecError(f"env.name {name!r}: {err}{cause}") from err
    if not isinstance(env, Environment):
        raise EnvironmentSpecError(f"env.name {name!r}: load_environment returned a {type(env).__name__}, not a "
                                   "verifiers Environment")
    if env.rubric.has_group_rewards:
        raise EnvironmentSpecError(f"env.name {name!r}: its rubric has group reward functions, which asyncflow's "
                                   "episodes (scored one by one) do not support")
    return env


def _load_file(name: str, path: Path, kwargs: dict):
    if not path.is_file():
        raise EnvironmentSpecError(f"env.name {name!r}: no such file {str(path)!r}")
    spec = importlib.util.spec_from_file_location(f"asyncflow_verifiers_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise EnvironmentSpecError(f"env.name {name!r}: {str(path)!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    load = getattr(module, "load_environment", None)
    if not callable(load):
        raise EnvironmentSpecError(f"env.name {name!r}: {str(path)!r} defines no load_environment")
    return load(**kwargs)


_SIGNAL_LOCK = threading.Lock()


@contextlib.contextmanager
def _own_signal_handlers():
    """Keep the process's SIGINT / SIGTERM handlers across the library's `Environment.__init__` (which installs
    its own, and can only do so on the main thread: elsewhere its calls are skipped)."""
    if threading.current_thread() is threading.main_thread():
        saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in saved.items():
                signal.signal(s, handler)
        return
    with _SIGNAL_LOCK:
        install, signal.signal = signal.signal, lambda signum, handler: None  # off the main thread: nothing to install
        try:
            yield
        finally:
            signal.signal = install


def absolute_env_name(name: str) -> str:
    """`verifiers:path/to/file.py` with the path made absolute (a Ray actor's working directory is not the
    driver's); a module or id unchanged."""
    target = name.removeprefix(PREFIX)
    return f"{PREFIX}{Path(target).resolve()}" if target.endswith(".py") else name


def load_verifiers_env(name: str, options: dict[str, Any] | None = None):
    """The environment `name` (`verifiers:MODULE_OR_ID` or `verifiers:path/to/file.py`) built by its
    `load_environment(**options)`: once per process and options. Raises `EnvironmentSpecError` naming it."""
    return _load(name, options_json(options))


def verifiers_examples(name: str, options: dict[str, Any] | None = None, limit: int | None = None) -> list[tuple]:
    """The environment's training rows as `(prompt, answer, metadata, source)`: the prompt is the row's messages
    as JSON, the metadata `{"verifiers_index": i}`. At most `limit` rows (in the dataset's order)."""
    env = load_verifiers_env(name, options)
    if env.dataset_source is None and env.dataset is None:
        raise EnvironmentSpecError(f"env.name {name!r}: the environment has no training dataset (only an "
                                   "eval_dataset)")
    dataset = env.get_dataset()
    count = len(dataset) if limit is None else min(limit, len(dataset))
    rows = []
    for i in range(count):
        row = dataset[i]
        rows.append((json.dumps(_plain_messages(row["prompt"])), str(row.get("answer", "")),
                     {"verifiers_index": i}, f"{name}[{i}]"))
    return rows


def _plain_messages(prompt) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    messages = []
    for m in prompt:
        m = m.model_dump() if hasattr(m, "model_dump") else dict(m)
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        messages.append({"role": m["role"], "content": content})
    return messages


def render_messages(tokenizer, prompt_json: str, chat_template: str | None = None) -> list[int]:
    """A training row's prompt (its messages as JSON) -> the ids the server gives the first call of its episode:
    the chat template (`chat_template`, else the tokenizer's) with the generation prompt, tokenized without
    special tokens added."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    text = tokenizer.apply_chat_template(json.loads(prompt_json), chat_template=template, tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class _Loop:
    """One event loop on a daemon thread per process: the library's rollouts (and their async client) run there."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None or not cls._loop.is_running():
                loop = asyncio.new_event_loop()
                started = threading.Event()
                loop.call_soon(started.set)
                threading.Thread(target=loop.run_forever, name="verifiers-loop", daemon=True).start()
                started.wait()
                cls._loop = loop
            return cls._loop


class VerifiersAgent:
    """The agent of `env.name: verifiers:...`: `agent(client, row)` runs one rollout of the environment for the
    row's dataset index with the episode's client and returns `{"reward": rubric reward, "scores": {name:
    score}}`. Picklable (a Ray replica builds its own environment); `prepare()` loads the environment where the
    worker is built."""

    def __init__(self, name: str, options: dict[str, Any] | None, sampling_args: dict[str, Any], timeout_s: float):
        self.name = name
        self.options = dict(options or {})
        self.sampling_args = dict(sampling_args)
        self.timeout_s = timeout_s
        self._client: Any = None  # the AsyncOpenAI of this process's server, built on the loop

    def __getstate__(self):
        return {**self.__dict__, "_client": None}

    def prepare(self) -> None:
        load_verifiers_env(self.name, self.options)

    def __call__(self, client, row) -> dict[str, Any]:
        env = load_verifiers_env(self.name, self.options)
        index = row.metadata["verifiers_index"]
        rollout_input = dict(env.get_dataset()[index])
        future = asyncio.run_coroutine_threadsafe(
            self._rollout(env, rollout_input, str(client.base_url), client.api_key, row.model), _Loop.get())
        try:
            output = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise
        reward = float(output.get("reward") or 0.0)
        if not math.isfinite(reward):
            raise ValueError(f"the rubric of {self.name} gave reward {reward!r}")
        if output.get("error") is not None:  # e.g. an empty reply: the library ends the rollout and still scores it
            log.debug("verifiers rollout %s ended on %r", row.episode_id, output["error"])
        scores = {str(k): float(v) for k, v in (output.get("metrics") or {}).items()
                  if isinstance(v, (int, float)) and math.isfinite(v)}
        return {"reward": reward, "scores": scores}

    async def _rollout(self, env, rollout_input: dict, base_url: str, api_key: str, model: str) -> dict:
        import openai
        from verifiers.legacy.clients import OpenAIChatCompletionsClient

        if self._client is None:
            self._client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                              timeout=self.timeout_s)
        client = OpenAIChatCompletionsClient(self._client.with_options(base_url=base_url, api_key=api_key))
        return await env.run_rollout(rollout_input, client, model, dict(self.sampling_args))


def rubric_only(completion: str, ground_truth: str, **metadata) -> float:
    """`reward.fns: auto` of a `verifiers:` environment: its episodes are scored by its rubric inside the episode
    (`VerifiersAgent`), so nothing calls this; a call is a bug and fails loudly."""
    raise RuntimeError("a verifiers environment's rows are scored by its rubric within the episode")
