"""Property-based (hypothesis) tests of the controller under concurrent producers and consumers on threads.

Each example draws a workload (producers, appends, group size, consumers per stage, batch sizes, sampler,
capacity) and runs it on an in-process queue: producer threads append prompts, scorer threads (task
"score") read prompts and write a score and per-token values derived from them, trainer threads (task
"train") read all three columns. Checked: every row reaches each task exactly once; no trainer gets a row
before its score was written; what a trainer reads is exactly what was written; rows in flight never
exceed the capacity; the partition clears once both tasks finished it.
"""

import threading

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow.transfer import GroupSampler, OldestFirst, SimilarLength, TokenBalanced, TransferQueue

TIMEOUT = 10.0  # a deadlock would end every wait in TransferTimeout after this long, failing the example


def prompt_of(producer: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(producer * 10_000 + k)
    return torch.randint(0, 50_000, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g)


def score_of(prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return prompt.double().mean().float(), prompt.float() / 3


@st.composite
def workloads(draw):
    group = draw(st.integers(1, 3))  # rows per append = one GRPO group
    scorers, trainers = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    score_batch = draw(st.integers(1, 4))
    sampler_name = draw(st.sampled_from(["oldest", "similar", "balanced", "group"]))
    train_batch = group * draw(st.integers(1, 3)) if sampler_name == "group" else draw(st.integers(1, 5))
    # rows held unacknowledged by consumers, plus what one batch and one append need: below it, a full
    # partition could starve consumers that wait for more ready rows (a configuration error, not a bug)
    safe = (trainers + 1) * train_batch + (scorers + group) * score_batch + group
    capacity = draw(st.none() | st.integers(safe, safe + 8))
    return {
        "producers": draw(st.integers(1, 4)), "appends": draw(st.integers(1, 5)), "group": group,
        "scorers": scorers, "trainers": trainers, "score_batch": score_batch, "train_batch": train_batch,
        "sampler": sampler_name, "capacity": capacity, "units": draw(st.integers(1, 3)),
    }  # fmt: skip


def make_sampler(name: str):
    return {"oldest": OldestFirst(), "similar": SimilarLength(), "balanced": TokenBalanced(2), "group": GroupSampler()}[
        name
    ]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads())
def test_concurrent_producers_and_consumers_exactly_once_never_early_intact(w):
    q = TransferQueue.local(num_storage_units=w["units"], tasks=("score", "train"), timeout=TIMEOUT)
    total = w["producers"] * w["appends"] * w["group"]
    q.create_partition("p", num_rows=total, capacity=w["capacity"], group_size=w["group"])
    lock = threading.Lock()
    written: dict[int, torch.Tensor] = {}
    scored_before_write: set[int] = set()  # a scorer adds a row here *before* its write makes the score ready
    got = {"score": [], "train": []}
    trained: list = []
    problems: list = []
    max_in_flight = [0]

    def guarded(fn, *args):
        try:
            fn(*args)
        except BaseException as err:  # reported by the assertion after join
            problems.append(repr(err))

    def note_in_flight():
        status = q.status("p")
        if status["exists"]:
            with lock:
                max_in_flight[0] = max(max_in_flight[0], status["in_flight"])

    def produce(producer):
        for a in range(w["appends"]):
            rows = [prompt_of(producer, a * w["group"] + j) for j in range(w["group"])]
            indices = q.append("p", {"prompt": rows}, group_ids=producer * 1000 + a, timeout=TIMEOUT)
            with lock:
                written.update(zip(indices, rows))
            note_in_flight()

    def score():
        for batch in q.loader("p", "score", ["prompt"], w["score_batch"], timeout=TIMEOUT):
            scores = [score_of(prompt) for prompt in batch.rows("prompt")]
            with lock:
                got["score"] += batch.meta.indices
                scored_before_write.update(batch.meta.indices)
            q.write("p", batch.meta.indices, {"score": [s for s, _ in scores], "values": [v for _, v in scores]})
            note_in_flight()

    def train():
        sampler = make_sampler(w["sampler"])
        for batch in q.loader("p", "train", ["prompt", "score", "values"], w["train_batch"], sampler=sampler):
            with lock:
                early = [i for i in batch.meta.indices if i not in scored_before_write]
                assert not early, f"rows {early} handed to the trainer before their score was written"
                got["train"] += batch.meta.indices
                trained.extend(zip(batch.meta.indices, *(batch.rows(c) for c in ("prompt", "score", "values"))))
            if w["sampler"] == "group":
                assert len(set(batch.meta.group_ids)) * w["group"] == len(batch), "incomplete group handed out"
            note_in_flight()

    threads = [threading.Thread(target=guarded, args=(produce, p)) for p in range(w["producers"])]
    threads += [threading.Thread(target=guarded, args=(score,)) for _ in range(w["scorers"])]
    threads += [threading.Thread(target=guarded, args=(train,)) for _ in range(w["trainers"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=4 * TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert not problems, problems
    assert len(written) == total
    for task in ("score", "train"):
        assert sorted(got[task]) == sorted(written), f"task {task!r}: rows lost or delivered twice"
    for index, prompt, score, values in trained:
        expected_score, expected_values = score_of(written[index])
        assert torch.equal(prompt, written[index]), f"row {index}: prompt differs from what was written"
        assert torch.equal(score, expected_score) and torch.equal(values, expected_values), f"row {index} corrupted"
    if w["capacity"] is not None:
        assert max_in_flight[0] <= w["capacity"]
    assert q.status("p") == {"exists": False, "cleared": "consumed"}
    metrics = q.metrics()
    assert metrics["consumed/train/values"] == metrics["produced/values"] == total
