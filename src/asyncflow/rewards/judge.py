"""Model-based rewards: a judge model behind an OpenAI-compatible `/chat/completions` endpoint scores each
completion.

Owns: `JudgeReward` (a reward function object, `fn(completion, ground_truth, **metadata) -> float`),
`JudgeError`, `template_fields` and `parse_score`.

Invariants:
- A call never waits past its budget (`budget_s`, at most every attempt's timeout plus the backoffs): waiting
  for a free slot, for an identical request in flight, each attempt (httpx timeouts, the body read checked
  against the deadline) and each backoff are all cut to the time left. `asyncflow` sets the budget under
  `reward.timeout_s`, so a slow judge is an error the runner counts, never a hung reward thread.
- A call that fails every attempt (timeout, connection error, HTTP 429 or 5xx; other statuses and malformed
  bodies are not retried), or whose answer holds no score inside `score_range`, raises `JudgeError`: the
  runner scores that sample 0.0 and counts it in `reward/errors`, like any reward that raises.
- At most `concurrency` requests of one `JudgeReward` are in flight at once (per process).
- Identical requests (the same rendered messages and settings) go out once: the last `cache_size` scores are
  kept, and a request identical to one in flight waits for its answer. Failures are not cached.
- Picklable (`reward.isolation: process`): the client, locks and cache are built in each process on first use.
- The API key is read from the environment variable `api_key_env` when the client is built, never stored in
  the object or the run's config. `httpx` (the `judge` extra) is imported on first use; without it a
  `JudgeReward` cannot be made (a config naming one does not load), and the error names the extra.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import string
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

TEMPLATE_FIELDS = ("prompt", "response", "answer")
RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
MAX_BODY_BYTES = 1 << 20  # a judge's answer is a few tokens: a larger body is an error, not read to the end
_START_LOCK = threading.Lock()


class JudgeError(RuntimeError):
    """One judge call gave no score (the endpoint failed every attempt, or its answer held no score)."""


def template_fields(template: str) -> set[str]:
    """The `{field}`s of a judge prompt template; ValueError for a malformed one or a field other than
    `TEMPLATE_FIELDS` (literal braces are doubled: `{{` `}}`)."""
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as err:
        raise ValueError(f"judge template is malformed ({err}); write literal braces as {{{{ and }}}}") from None
    unknown = fields - set(TEMPLATE_FIELDS)
    if unknown:
        raise ValueError(f"judge template names {sorted(unknown)}; it may use {{prompt}}, {{response}}, {{answer}}")
    return fields


def parse_score(text: str, pattern: re.Pattern, low: float, high: float) -> float:
    """The score in a judge's answer, mapped from [low, high] to [0, 1]: the first match of `pattern` (its
    first group if it has one). Raises JudgeError when nothing matches or the number is out of range."""
    match = pattern.search(text)
    if match is None:
        raise JudgeError(f"the judge's answer {text[:80]!r} holds no score (score_pattern {pattern.pattern!r})")
    found = match.group(1) if pattern.groups else match.group(0)
    try:
        value = float(found)
    except ValueError:
        raise JudgeError(f"the judge's score {found!r} is not a number") from None
    if not low <= value <= high:
        raise JudgeError(f"the judge's score {value:g} is outside score_range [{low:g}, {high:g}]")
    return (value - low) / (high - low)


class JudgeReward:
    """A reward scored by a judge model; see the module invariants.

    base_url: the endpoint's OpenAI base URL (e.g. `http://127.0.0.1:8001/v1`); model: the model name sent.
    template: the user message, with `{prompt}`, `{response}` (the completion) and `{answer}` (the ground
    truth); `{prompt}` needs the row's prompt text in its metadata (`prompt`). system: an optional system
    message. score_pattern / score_range: see `parse_score`. timeout_s: per attempt; retries: further
    attempts after a failed one, `backoff_s * 2**k` apart; budget_s: a limit on all of them together.
    """

    def __init__(self, base_url: str, model: str, *, template: str, system: str | None = None,
                 score_pattern: str = r"-?\d+(?:\.\d+)?", score_range: tuple[float, float] = (0.0, 1.0),
                 max_tokens: int = 16, temperature: float = 0.0, api_key_env: str | None = None,
                 concurrency: int = 4, timeout_s: float = 30.0, retries: int = 2, backoff_s: float = 1.0,
                 budget_s: float | None = None, cache_size: int = 4096, name: str | None = None):
        if importlib.util.find_spec("httpx") is None:
            raise ValueError("a judge reward needs httpx: pip install 'asyncflow-rl[judge]'")
        self.fields = template_fields(template)
        low, high = score_range
        if not low < high:
            raise ValueError(f"judge score_range must be [low, high] with low < high, got {list(score_range)}")
        try:
            self.pattern = re.compile(score_pattern)
        except re.error as err:
            raise ValueError(f"judge score_pattern {score_pattern!r} is not a regular expression: {err}") from None
        if not (concurrency >= 1 and timeout_s > 0 and retries >= 0 and backoff_s >= 0 and cache_size >= 0):
            raise ValueError("judge: concurrency >= 1, timeout_s > 0, retries >= 0, backoff_s >= 0, cache_size >= 0")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.template, self.system = model, template, system
        self.score_range = (float(low), float(high))
        self.max_tokens, self.temperature, self.api_key_env = max_tokens, temperature, api_key_env
        self.concurrency, self.timeout_s, self.retries, self.backoff_s = concurrency, timeout_s, retries, backoff_s
        every_attempt_s = (retries + 1) * timeout_s + backoff_s * (2**retries - 1)
        self.budget_s = min(budget_s, every_attempt_s) if budget_s else every_attempt_s
        self.cache_size = cache_size
        self.reward_name = name or f"judge:{model}"
        self.requests_sent = 0  # attempts that reached the network, in this process
        self.cache_hits = 0  # calls answered from the cache or by an identical call in flight
        self._live: _Live | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_live": None}

    def __call__(self, completion: str, ground_truth: str, **metadata) -> float:
        deadline = time.monotonic() + self.budget_s
        body = self.request_body(completion, ground_truth, metadata)
        live = self._live or self._start()
        key = json.dumps(body, sort_keys=True)
        future, owner = live.claim(key)
        if not owner:
            with live.lock:
                self.cache_hits += 1
            try:
                return future.result(timeout=max(deadline - time.monotonic(), 0.0))
            except FutureTimeout:
                raise JudgeError(f"an identical judge request was still running after {self.budget_s:g} s") from None
        try:
            score = self._score(live, body, deadline)
        except BaseException as err:
            live.forget(key)
            future.set_exception(err)
            raise
        future.set_result(score)
        return score

    def request_body(self, completion: str, ground_truth: str, metadata: dict) -> dict:
        """The chat request for one sample."""
        if "prompt" in self.fields and "prompt" not in metadata:
            raise JudgeError("the judge template uses {prompt} but the row's metadata has no 'prompt' text")
        values = {"prompt": metadata.get("prompt", ""), "response": completion, "answer": ground_truth}
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": self.template.format_map(values)})
        return {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                "temperature": self.temperature}

    def _start(self) -> _Live:
        with _START_LOCK:
            if self._live is None:
                self._live = _Live(self)
            return self._live

    def _score(self, live: _Live, body: dict, deadline: float) -> float:
        if not live.slots.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            raise JudgeError(f"no free judge slot (concurrency {self.concurrency}) within {self.budget_s:g} s")
        try:
            text = self._answer(live, body, deadline)
        finally:
            live.slots.release()
        return parse_score(text, self.pattern, *self.score_range)

    def _answer(self, live: _Live, body: dict, deadline: float) -> str:
        """The judge's answer text, after at most `retries + 1` attempts within `deadline`."""
        import httpx

        failure = "no attempt fitted in the budget"
        for attempt in range(self.retries + 1):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with live.lock:
                self.requests_sent += 1
            try:
                status, raw = self._post(live.client, body, min(self.timeout_s, left), deadline)
            except (httpx.TransportError, TimeoutError) as err:
                failure = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            else:
                if status == 200:
                    return _answer_text(raw)
                failure = f"HTTP {status}: {raw[:200].decode(errors='replace')}"
                if status not in RETRIED_STATUSES:
                    break
            if attempt < self.retries:
                time.sleep(min(self.backoff_s * 2**attempt, max(deadline - time.monotonic(), 0.0)))
        raise JudgeError(f"the judge at {self.url} gave no answer: {failure}")

    def _post(self, client, body: dict, timeout_s: float, deadline: float) -> tuple[int, bytes]:
        """(status, body) of one attempt; TimeoutError once `deadline` passes while the body is read."""
        with client.stream("POST", self.url, json=body, timeout=timeout_s) as response:
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise JudgeError(f"the judge's response is over {MAX_BODY_BYTES} bytes")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the judge's response was still arriving after {self.budget_s:g} s")
            return response.status_code, b"".join(chunks)

    def __repr__(self) -> str:
        return f"JudgeReward({self.reward_name!r}, url={self.url!r})"


class _Live:
    """What a `JudgeReward` holds while it runs in one process: the HTTP client, the slots and the cache."""

    def __init__(self, judge: JudgeReward):
        import httpx

        headers = {}
        if judge.api_key_env:
            key = os.environ.get(judge.api_key_env)
            if not key:
                raise JudgeError(f"the judge's API key variable {judge.api_key_env!r} is not set")
            headers["Authorization"] = f"Bearer {key}"
        self.client = httpx.Client(headers=headers, limits=httpx.Limits(max_connections=judge.concurrency))
        self.slots = threading.BoundedSemaphore(judge.concurrency)
        self.cache_size = judge.cache_size
        self.lock = threading.Lock()
        self.cache: OrderedDict[str, Future] = OrderedDict()

    def claim(self, key: str) -> tuple[Future, bool]:
        """(the future of `key`'s score, whether the caller must compute it)."""
        with self.lock:
            future = self.cache.get(key)
            if future is not None:
                self.cache.move_to_end(key)
                return future, False
            future = Future()
            if self.cache_size:
                self.cache[key] = future
                while len(self.cache) > self.cache_size:
                    self.cache.popitem(last=False)
            return future, True

    def forget(self, key: str) -> None:
        with self.lock:
            self.cache.pop(key, None)


def _answer_text(raw: bytes) -> str:
    """`choices[0].message.content` of a chat completion body; JudgeError for anything else."""
    try:
        content = json.loads(raw)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        shown = raw[:200].decode(errors="replace")
        raise JudgeError(f"the judge's response is not a chat completion: {shown!r}") from None
    if not isinstance(content, str):
        raise JudgeError(f"the judge's answer is {type(content).__name__}, not text")
    return content
