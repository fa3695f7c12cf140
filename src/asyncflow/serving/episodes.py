"""Episodes: what the OpenAI-compatible server recorded for one agent run, and the training row made of it.

Owns: `EpisodeRecorder` (thread-safe: calls by episode id, each episode's latest context so a later
call that extends it reuses its token ids, and the tool-calling turns it returned, by their call ids, so a
later call that sends one back renders the text that was sampled: `serving.tool_calling`) and `episode_row`
(an episode's calls -> one training row).

How an episode becomes a row (`episode_row`). The row's prompt is the first call's prompt ids; its
response is, call after call, the new context the agent added (loss mask 0, log-prob 0) followed by the
ids the model sampled (loss mask 1, their sampling log-probs). A call whose prompt does not start with
the row's context so far (the agent rewrote or cut its history) ends the row: that call and every later
one are left out of training and counted in `EpisodeRow.dropped_calls`, never re-tokenized into it.

Invariants:
- Every id of `response_ids` with loss mask 1 is an id the engine sampled, in order, with its log-prob
  and weight version; ids with mask 0 come from the agent's prompts, byte for byte.
- `EpisodeRow.retokenize_drift_tokens` (trained ids against the kept calls' sampled ids) is 0.
- `prompt_ids + response_ids` equals the last kept call's prompt ids followed by its sampled ids.
- An episode takes calls only while it is open: `open` .. `close`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from asyncflow.engines.base import Transcript
from asyncflow.serving.tool_calling import ToolTurn


@dataclass(frozen=True)
class CallRecord:
    """One generation the server ran for an episode: the prompt it was given and what it sampled."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    weight_version: int
    finish_reason: str


@dataclass
class EpisodeRow(Transcript):
    """An agent episode's training row."""

    finish_reason: str = "stop"
    calls: int = 0  # calls in the row
    dropped_calls: int = 0  # calls after the first one that did not extend the row's context
    retokenize_drift_tokens: int = 0  # trained ids that differ from the kept calls' sampled ids (stays 0)

    @property
    def weight_version(self) -> int:
        """The oldest version that sampled a trained token (what staleness is counted from)."""
        return min(self.token_versions, default=0)


def episode_row(calls: list[CallRecord]) -> EpisodeRow | None:
    """An episode's calls (in the order they were made) -> its training row; None for an episode without calls.
    See the module docstring for how the row is built and when calls are dropped."""
    if not calls:
        return None
    row = EpisodeRow(prompt_ids=list(calls[0].prompt_ids))
    context = list(calls[0].prompt_ids)
    for index, call in enumerate(calls):
        if call.prompt_ids[: len(context)] != context:
            row.dropped_calls = len(calls) - index
            break
        row.add_appended(call.prompt_ids[len(context) :], call.weight_version)
        row.add_sampled(call.response_ids, call.logprobs, call.weight_version)
        row.finish_reason = call.finish_reason
        row.calls += 1
        context = call.prompt_ids + call.response_ids
    row.retokenize_drift_tokens = row.count_retokenize_drift([call.response_ids for call in calls[: row.calls]])
    return row


class UnknownEpisodeError(KeyError):
    """A call names an episode that is not open."""


class EpisodeRecorder:
    """Calls by episode id, for the episodes opened and not yet closed (thread-safe)."""

    def __init__(self):
        self._calls: dict[str, list[CallRecord]] = {}
        self._contexts: dict[str, tuple[str, list[int], str]] = {}  # (kind, ids, text) of the latest call
        self._tool_turns: dict[str, dict[tuple[str, ...], tuple[str, ToolTurn]]] = {}  # by episode, by call ids
        self._lock = threading.Lock()

    def open(self, episode_id: str) -> None:
        with self._lock:
            if episode_id in self._calls:
                raise ValueError(f"episode {episode_id!r} is already open")
            self._calls[episode_id] = []

    def is_open(self, episode_id: str) -> bool:
        with self._lock:
            return episode_id in self._calls

    def record(self, episode_id: str, call: CallRecord, *, kind: str, text: str) -> None:
        """Add a call; `text` is the context after it as the agent sees it (prompt text + completion text)."""
        with self._lock:
            if episode_id not in self._calls:
                raise UnknownEpisodeError(episode_id)
            self._calls[episode_id].append(call)
            self._contexts[episode_id] = (kind, call.prompt_ids + call.response_ids, text)

    def record_tool_turn(self, episode_id: str, call_ids: tuple[str, ...], text: str, turn: ToolTurn) -> None:
        """Remember an assistant turn with tool calls: the text the model sampled and the `turn` returned for it."""
        with self._lock:
            if episode_id not in self._calls:
                raise UnknownEpisodeError(episode_id)
            self._tool_turns.setdefault(episode_id, {})[call_ids] = (text, turn)

    def tool_turn(self, episode_id: str, call_ids: tuple[str, ...]) -> tuple[str, ToolTurn] | None:
        """(sampled text, turn returned) of the episode's tool-calling turn with these call ids, if it returned one."""
        with self._lock:
            return self._tool_turns.get(episode_id, {}).get(call_ids)

    def context(self, episode_id: str, kind: str) -> tuple[list[int], str] | None:
        """(ids, text) of the episode's latest context, if its latest call was of `kind` ("chat" or "completion":
        a context is reused only by a call of the same kind)."""
        with self._lock:
            latest_kind, ids, text = self._contexts.get(episode_id, (None, [], ""))
            return (list(ids), text) if latest_kind == kind else None

    def close(self, episode_id: str) -> list[CallRecord]:
        """End the episode (later calls to it are refused) and return its calls in order."""
        with self._lock:
            self._contexts.pop(episode_id, None)
            self._tool_turns.pop(episode_id, None)
            return self._calls.pop(episode_id, [])
