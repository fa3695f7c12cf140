"""Who was busy when: busy spans per worker, exported as a Chrome/Perfetto trace, a Gantt PNG (the whole
run, and a zoom on a few steps from its middle) and a utilization PNG (each worker's busy fraction per
time bin), and summarised as idle fractions.

Owns: `Timeline`, `span_step`.
An event is a plain dict, so a remote worker can return its events (pickle or JSON) and the driver
`merge`s them:
    {"kind": "span" | "instant", "worker": str, "name": str, "start_s": float, "end_s": float, "args": dict}
Times are wall-clock seconds (`time.time()`), the only clock shared by processes on one machine;
a span measured here takes its duration from `time.perf_counter()`, so it is never negative.
Invariants:
- Recording is thread-safe; `events` returns a copy.
- Every stored event has end_s >= start_s (instants: end_s == start_s).
- Spans whose name starts with "wait" mean "idle, waiting": they are drawn, but count as idle.
  Busy time is the union of a worker's other spans, so overlapping spans (one worker, several
  threads) are not counted twice. This one definition gives `idle_fractions`, `utilization` (the
  busy fraction of each time bin is 1 - the idle fraction of that bin) and both PNGs.
- A span belongs to a step when its args name one (`span_step`): `step` (an int) or `partition`
  ("step_12"). The Gantt's zoom is chosen from these, or is a time window when no span names a step.
- matplotlib is imported only when a PNG is drawn (workers that only record spans never load it).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncflow.observe.plots import save_png

if TYPE_CHECKING:
    from matplotlib.axes import Axes

_REQUIRED_KEYS = ("kind", "worker", "name", "start_s", "end_s")
_IDLE_PREFIX = "wait"
_STEP_SUFFIX = re.compile(r"(\d+)$")
_FALLBACK_ZOOM_SPANS = 12  # without step args, the zoom holds about this many spans of the busiest worker
_ZOOM_AT_MOST = 0.5  # the Gantt has a zoom panel only when its window is shorter than this share of the run
_INSTANT_MARKERS = ("v", "X", "*", "D", "P")


def span_step(event: Mapping[str, Any]) -> int | None:
    """The step an event belongs to: its `step` arg when that is an int, else the number that ends its
    `partition` arg ("step_12" -> 12); None when it names neither."""
    args = event.get("args") or {}
    step = args.get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    partition = args.get("partition")
    match = _STEP_SUFFIX.search(partition) if isinstance(partition, str) else None
    return int(match.group(1)) if match else None


class Timeline:
    def __init__(self, events: Iterable[Mapping[str, Any]] = ()) -> None:
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self.merge(events)

    @contextmanager
    def span(self, worker: str, name: str, **args: Any) -> Iterator[None]:
        """Record the time spent inside the `with` block as a span of `worker` (also on error)."""
        start_s, start_perf = time.time(), time.perf_counter()
        try:
            yield
        finally:
            self._append(_event("span", worker, name, start_s, start_s + time.perf_counter() - start_perf, args))

    def instant(self, worker: str, name: str, **args: Any) -> None:
        """Record a point event (e.g. "weights v3 loaded") at the current time."""
        now = time.time()
        self._append(_event("instant", worker, name, now, now, args))

    def add_span(self, worker: str, name: str, start_s: float, end_s: float, **args: Any) -> None:
        """Record a span measured elsewhere, with wall-clock (`time.time()`) start and end."""
        self._append(_event("span", worker, name, start_s, end_s, args))

    def merge(self, other_events: Timeline | Iterable[Mapping[str, Any]]) -> None:
        """Add events from another Timeline or an events list (e.g. shipped back by a remote worker)."""
        source = other_events.events if isinstance(other_events, Timeline) else other_events
        checked = []
        for index, raw in enumerate(source):
            if not isinstance(raw, Mapping) or any(key not in raw for key in _REQUIRED_KEYS):
                raise ValueError(f"timeline event {index} must be a dict with keys {_REQUIRED_KEYS}; got {raw!r}")
            try:
                checked.append(_event(raw["kind"], raw["worker"], raw["name"], raw["start_s"], raw["end_s"],
                                      raw.get("args", {})))
            except (TypeError, ValueError) as err:
                raise ValueError(f"timeline event {index}: {err}") from None
        with self._lock:
            self._events.extend(checked)

    @property
    def events(self) -> list[dict[str, Any]]:
        """A copy of all events, in recording order."""
        with self._lock:
            return [dict(event, args=dict(event["args"])) for event in self._events]

    def workers(self) -> list[str]:
        """Worker names in order of first appearance."""
        return list(dict.fromkeys(event["worker"] for event in self.events))

    def to_chrome_trace(self, path: str | Path) -> Path:
        """Write Chrome trace JSON (open in https://ui.perfetto.dev or chrome://tracing): one
        process/thread row per worker, named after it; `ts`/`dur` in microseconds since the earliest
        event, whose wall-clock time is kept in `otherData.origin_unix_s`."""
        events = self.events
        origin = min((event["start_s"] for event in events), default=0.0)
        rows = {worker: row for row, worker in enumerate(dict.fromkeys(event["worker"] for event in events), start=1)}
        trace: list[dict[str, Any]] = []
        for worker, row in rows.items():
            trace.append({"ph": "M", "name": "process_name", "pid": row, "tid": row, "args": {"name": worker}})
            trace.append({"ph": "M", "name": "process_sort_index", "pid": row, "tid": row, "args": {"sort_index": row}})
            trace.append({"ph": "M", "name": "thread_name", "pid": row, "tid": row, "args": {"name": worker}})
        for event in events:
            row = rows[event["worker"]]
            entry = {"name": event["name"], "cat": event["worker"], "pid": row, "tid": row,
                     "ts": (event["start_s"] - origin) * 1e6, "args": event["args"]}
            if event["kind"] == "span":
                entry.update(ph="X", dur=(event["end_s"] - event["start_s"]) * 1e6)
            else:
                entry.update(ph="i", s="t")
            trace.append(entry)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        document = {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": {"origin_unix_s": origin}}
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(document, default=repr), encoding="utf-8")
        os.replace(tmp, path)  # a reader (or a resumed run) never sees half a trace
        return path

    @classmethod
    def from_chrome_trace(cls, path: str | Path) -> Timeline:
        """The events of a trace `to_chrome_trace` wrote (a resumed run continues its timeline)."""
        document = json.loads(Path(path).read_text(encoding="utf-8"))
        origin = document.get("otherData", {}).get("origin_unix_s", 0.0)
        events = []
        for entry in document["traceEvents"]:
            if entry.get("ph") not in ("X", "i"):
                continue
            start_s = origin + entry["ts"] / 1e6
            end_s = start_s + entry.get("dur", 0.0) / 1e6
            events.append({"kind": "span" if entry["ph"] == "X" else "instant", "worker": entry["cat"],
                           "name": entry["name"], "start_s": start_s, "end_s": end_s, "args": entry.get("args", {})})
        return cls(events)

    def step_windows(self) -> dict[int, tuple[float, float]]:
        """Per step named by a span (`span_step`), in step order: (earliest start, latest end) of its spans."""
        windows: dict[int, tuple[float, float]] = {}
        for span in self._spans():
            step = span_step(span)
            if step is not None:
                start, end = windows.get(step, (span["start_s"], span["end_s"]))
                windows[step] = (min(start, span["start_s"]), max(end, span["end_s"]))
        return dict(sorted(windows.items()))

    def zoom_window(self, steps: int = 3) -> tuple[list[int], tuple[float, float]]:
        """The stretch the Gantt zooms on, as (steps, (start_s, end_s)): `steps` consecutive recorded steps
        near the middle of the run, from the earliest start to the latest end of their spans.

        A typical stretch is wanted, not one with an evaluation or a checkpoint in it: candidates are the
        stretches whose every step has the most common set of span names (an evaluation adds a name),
        and of those the ones no slower than their median, where a stretch takes as long as the run took
        to finish its steps (from the end of the step before it to the end of its last step). Of these,
        the one whose middle is nearest the middle recorded step wins (the earlier on a tie). When no span
        names a step: ([], a window centred on the middle of the run that holds about a dozen spans of
        the busiest worker). Raises ValueError when no span is recorded."""
        if steps < 1:
            raise ValueError(f"zoom_window: steps must be >= 1, got {steps!r}")
        spans = self._spans()
        if not spans:
            raise ValueError("zoom_window: no spans recorded")
        windows = self.step_windows()
        if not windows:
            run_start, run_end = _extent(spans)
            busiest = max(Counter(span["worker"] for span in spans).values())
            half = (run_end - run_start) * min(1.0, _FALLBACK_ZOOM_SPANS / busiest) / 2
            middle = (run_start + run_end) / 2
            return [], (middle - half, middle + half)
        numbers = list(windows)
        ends = [windows[number][1] for number in numbers]
        count = min(steps, len(numbers))
        firsts: Sequence[int] = range(len(numbers) - count + 1)  # a stretch is numbers[first : first + count]
        consecutive = [first for first in firsts if numbers[first + count - 1] - numbers[first] == count - 1]
        firsts = consecutive or list(firsts)  # a stretch across a gap in the record only when there is no other
        names: dict[int, set[str]] = {number: set() for number in numbers}
        for span in spans:
            step = span_step(span)
            if step is not None:
                names[step].add(span["name"])
        usual = Counter(frozenset(step_names) for step_names in names.values()).most_common(1)[0][0]
        typical = [first for first in firsts if all(names[step] == usual for step in numbers[first : first + count])]
        firsts = typical or firsts
        took = {first: ends[first + count - 1] - (ends[first - 1] if first else windows[numbers[0]][0])
                for first in firsts}
        median = sorted(took.values())[(len(took) - 1) // 2]  # the lower median is one of the values
        middle = (len(numbers) - count) / 2
        best = min((first for first in firsts if took[first] <= median), key=lambda first: abs(first - middle))
        stretch = numbers[best : best + count]
        return stretch, (min(windows[number][0] for number in stretch), max(windows[number][1] for number in stretch))

    def gantt_png(self, path: str | Path, title: str = "worker timeline", zoom_steps: int = 3) -> Path:
        """One row per worker, one colour per span name (legend), wait spans faint, instants as markers,
        x in seconds since the earliest span. Top panel: the whole run, with the zoomed stretch shaded
        and steps marked on the top axis. Bottom panel: a zoom on `zoom_steps` steps (`zoom_window`),
        each span labelled with its step where the label fits; left out when the zoom would show most
        of the run anyway."""
        from matplotlib.figure import Figure  # imported here so workers that only record spans skip it

        events = self.events
        spans = [event for event in events if event["kind"] == "span"]
        instants = [event for event in events if event["kind"] == "instant"]
        workers = list(dict.fromkeys(event["worker"] for event in events))
        if not spans:
            figure = Figure(figsize=(10, 1.0 + 0.5 * max(len(workers), 1)), layout="constrained")
            ax = figure.subplots()
            ax.set_title(f"{title} (no spans recorded)")
            return save_png(figure, path)
        run_start, run_end = _extent(spans)
        zoom_steps_found, zoom = self.zoom_window(zoom_steps)
        show_zoom = zoom[1] - zoom[0] < _ZOOM_AT_MOST * (run_end - run_start)
        names = list(dict.fromkeys(span["name"] for span in spans))
        colours = _colours(names)
        panel_height = 1.1 + 0.42 * len(workers)
        figure = Figure(figsize=(13, 0.3 + panel_height * (2 if show_zoom else 1)), layout="constrained")
        axes = figure.subplots(2 if show_zoom else 1, 1, squeeze=False)[:, 0]
        overview = axes[0]
        _draw_lanes(overview, spans, instants, workers, colours, run_start, (run_start, run_end), detailed=False)
        windows = self.step_windows()
        _step_axis(overview, windows, run_start)
        summary = f"steps {min(windows)}-{max(windows)}, " if windows else ""
        overview.set_title(f"{title}: whole run ({summary}{run_end - run_start:.1f} s)", loc="left")
        if show_zoom:
            overview.axvspan(zoom[0] - run_start, zoom[1] - run_start, color="0.3", alpha=0.18, zorder=0,
                             label="zoomed below")
            detail = axes[1]
            _draw_lanes(detail, spans, instants, workers, colours, run_start, zoom, detailed=True)
            if zoom_steps_found:
                first, last = zoom_steps_found[0], zoom_steps_found[-1]
                what = f"step {first}" if first == last else f"steps {first}-{last}"
                what += " (bars labelled with their step)"
            else:
                what = "the middle of the run"
            detail.set_title(f"zoom on {what}: {zoom[0] - run_start:.2f}-{zoom[1] - run_start:.2f} s", loc="left")
        axes[-1].set_xlabel("seconds since the first span")
        handles, labels = overview.get_legend_handles_labels()
        figure.legend(handles, labels, loc="outside right upper", fontsize="small", title="span (wait* = idle)",
                      title_fontsize="small")
        return save_png(figure, path)

    def utilization(
        self, bins: int | None = None, window: tuple[float, float] | None = None,
    ) -> tuple[list[float], dict[str, list[float]]]:
        """Busy fraction of each worker with spans in each of `bins` equal time bins over `window`
        (default: earliest start to latest end), as (bin edges in wall-clock seconds, bins + 1 of them;
        {worker: one fraction per bin}). Busy as in `idle_fractions`: a bin's fraction is 1 - the idle
        fraction of that bin. `bins` defaults to about two steps a bin (10 to 100 bins) when spans name
        steps, else 100. Raises ValueError when there are no spans or the window has no length."""
        spans = self._spans()
        if not spans:
            raise ValueError("utilization: no spans recorded")
        window_start, window_end = _window(spans, window, "utilization")
        if bins is None:
            steps = len(self.step_windows())
            bins = min(100, max(10, steps // 2)) if steps else 100
        if bins < 1:
            raise ValueError(f"utilization: bins must be >= 1, got {bins!r}")
        width = (window_end - window_start) / bins
        edges = [window_start + index * width for index in range(bins)] + [window_end]
        busy = {worker: _binned(_busy_intervals(spans, worker), edges)
                for worker in dict.fromkeys(span["worker"] for span in spans)}
        return edges, busy

    def utilization_png(
        self, path: str | Path, title: str = "workers", bins: int | None = None,
    ) -> Path:
        """One row per worker: the busy fraction of each time bin over the run (`utilization`), with the
        share of the whole run it was busy (1 - its idle fraction); steps marked on the top axis."""
        from matplotlib.figure import Figure
        from matplotlib.ticker import PercentFormatter

        spans = self._spans()
        run_start, run_end = _extent(spans) if spans else (0.0, 0.0)
        if not run_end > run_start:
            figure = Figure(figsize=(10, 1.5), layout="constrained")
            figure.subplots().set_title(f"{title} (no spans with a length recorded)")
            return save_png(figure, path)
        edges, busy = self.utilization(bins)
        idle = self.idle_fractions()
        figure = Figure(figsize=(13, 0.9 + 0.95 * len(busy)), layout="constrained")
        axes = figure.subplots(len(busy), 1, sharex=True, squeeze=False)[:, 0]
        x = [edge - run_start for edge in edges]
        for index, (ax, (worker, fractions)) in enumerate(zip(axes, busy.items())):
            colour = f"C{index % 10}"
            ax.stairs(fractions, x, fill=True, color=colour, alpha=0.3)
            ax.stairs(fractions, x, color=colour, linewidth=1.2)
            ax.set_ylim(0, 1.08)
            ax.set_xlim(x[0], x[-1])
            ax.set_yticks([0, 0.5, 1])
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
            ax.set_ylabel(f"{worker}\nbusy {1 - idle[worker]:.0%}\nof the run", rotation=0, ha="right", va="center")
            ax.grid(alpha=0.3)
        _step_axis(axes[0], self.step_windows(), run_start)
        axes[0].set_title(f"{title}: busy fraction per {edges[1] - edges[0]:.3g} s bin (busy = inside a span not named "
                          "wait*)", loc="left")
        axes[-1].set_xlabel("seconds since the first span")
        return save_png(figure, path)

    def idle_fractions(self, window: tuple[float, float] | None = None) -> dict[str, float]:
        """Per worker with spans: 1 - (union of its non-wait spans inside the window) / window length.
        `window` is (start_s, end_s) in wall-clock seconds; default: earliest start to latest end."""
        spans = self._spans()
        if not spans:
            return {}
        window_start, window_end = _window(spans, window, "idle_fractions")
        fractions = {}
        for worker in dict.fromkeys(span["worker"] for span in spans):
            busy = sum(max(0.0, min(end, window_end) - max(start, window_start))
                       for start, end in _busy_intervals(spans, worker))
            fractions[worker] = 1.0 - busy / (window_end - window_start)
        return fractions

    def _spans(self) -> list[dict[str, Any]]:
        return [event for event in self.events if event["kind"] == "span"]

    def _append(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._events.append(event)


def _event(kind: str, worker: str, name: str, start_s: float, end_s: float, args: Mapping[str, Any]) -> dict[str, Any]:
    if kind not in ("span", "instant"):
        raise ValueError(f"kind must be 'span' or 'instant', got {kind!r}")
    for label, text in (("worker", worker), ("name", name)):
        if not isinstance(text, str) or not text:
            raise ValueError(f"{label} must be a non-empty string, got {text!r}")
    start_s, end_s = float(start_s), float(end_s)
    if end_s < start_s:
        raise ValueError(f"span {worker}/{name} ends ({end_s}) before it starts ({start_s})")
    return {"kind": kind, "worker": worker, "name": name, "start_s": start_s, "end_s": end_s, "args": dict(args)}


def _extent(spans: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    return min(span["start_s"] for span in spans), max(span["end_s"] for span in spans)


def _window(spans: Sequence[Mapping[str, Any]], window: tuple[float, float] | None, what: str) -> tuple[float, float]:
    """`window`, or the spans' extent when None; ValueError when it has no length."""
    start, end = _extent(spans) if window is None else window
    if not end > start:
        raise ValueError(f"{what}: window {(start, end)} has no length (end must be after start)")
    return start, end


def _busy_intervals(spans: Sequence[Mapping[str, Any]], worker: str) -> list[tuple[float, float]]:
    """The union of `worker`'s non-wait spans, as sorted disjoint (start, end) intervals."""
    merged: list[list[float]] = []
    for start, end in sorted((span["start_s"], span["end_s"]) for span in spans
                             if span["worker"] == worker and not span["name"].startswith(_IDLE_PREFIX)):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _binned(intervals: Sequence[tuple[float, float]], edges: Sequence[float]) -> list[float]:
    """Share of each bin [edges[i], edges[i+1]] that disjoint `intervals` cover (equal-width bins)."""
    bins = len(edges) - 1
    width = (edges[-1] - edges[0]) / bins
    covered = [0.0] * bins
    for start, end in intervals:
        first = max(0, int((start - edges[0]) // width))
        last = min(bins - 1, int((end - edges[0]) // width))
        for index in range(first, last + 1):
            covered[index] += max(0.0, min(end, edges[index + 1]) - max(start, edges[index]))
    return [min(1.0, value / (edges[index + 1] - edges[index])) for index, value in enumerate(covered)]


def _colours(names: Sequence[str]) -> dict[str, Any]:
    if len(names) <= 10:
        return {name: f"C{index}" for index, name in enumerate(names)}
    from matplotlib import colormaps

    return {name: colormaps["tab20"](index % 20) for index, name in enumerate(names)}


def _draw_lanes(ax: Axes, spans: Sequence[Mapping[str, Any]], instants: Sequence[Mapping[str, Any]],
                workers: Sequence[str], colours: Mapping[str, Any], origin: float, window: tuple[float, float],
                detailed: bool) -> None:
    """Gantt rows of `workers` over `window`; `detailed` (a zoom) hatches wait spans, outlines bars and
    labels each span that is wide enough with its step."""
    window_start, window_end = window
    rows = {worker: row for row, worker in enumerate(workers)}
    shown = [span for span in spans if span["end_s"] >= window_start and span["start_s"] <= window_end]
    for name, colour in colours.items():
        idle = name.startswith(_IDLE_PREFIX)
        label = name
        for worker, row in rows.items():
            bars = [(span["start_s"] - origin, span["end_s"] - span["start_s"])
                    for span in shown if span["worker"] == worker and span["name"] == name]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colour, alpha=0.35 if idle else 0.9,
                               hatch="//" if idle and detailed else None, edgecolor="white" if detailed else "none",
                               linewidth=0.5 if detailed else 0, label=label)
                label = "_nolegend_"  # one legend entry per span name
    if detailed:
        min_width = 0.03 * (window_end - window_start)
        for span in shown:
            step = span_step(span)
            start, end = max(span["start_s"], window_start), min(span["end_s"], window_end)  # the part shown
            if step is not None and end - start >= min_width:
                ax.text((start + end) / 2 - origin, rows[span["worker"]], str(step), ha="center", va="center",
                        fontsize=7, clip_on=True)
    for index, name in enumerate(dict.fromkeys(event["name"] for event in instants)):
        points = [(event["start_s"] - origin, rows[event["worker"]] - 0.42) for event in instants
                  if event["name"] == name and window_start <= event["start_s"] <= window_end]
        if points:
            ax.plot(*zip(*points), linestyle="none", marker=_INSTANT_MARKERS[index % len(_INSTANT_MARKERS)],
                    color="black", markersize=7, label=f"{name} (instant)")
    ax.set_yticks(range(len(workers)), labels=workers)
    ax.set_ylim(-0.6, len(workers) - 0.4)
    ax.invert_yaxis()
    ax.set_xlim(window_start - origin, window_end - origin)
    ax.grid(axis="x", alpha=0.3)


def _step_axis(ax: Axes, windows: Mapping[int, tuple[float, float]], origin: float) -> None:
    """Mark about ten steps on the top axis, each where its last span ended."""
    if not windows:
        return
    from matplotlib.ticker import MaxNLocator

    numbers = list(windows)
    wanted = MaxNLocator(nbins=10, integer=True).tick_values(numbers[0], numbers[-1])
    ticks = sorted({min(numbers, key=lambda number: abs(number - value)) for value in wanted})
    top = ax.secondary_xaxis("top")
    top.set_xticks([windows[number][1] - origin for number in ticks], labels=[str(number) for number in ticks])
    top.tick_params(labelsize="small")
    top.set_xlabel("step (where its last span ended)", fontsize="small")
