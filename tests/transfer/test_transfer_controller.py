"""Controller invariants under random interleavings of appends, writes, requests and resets (hypothesis),
and the samplers' contracts."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from asyncflow.transfer import (
    ColumnSpec,
    Controller,
    FilledCellError,
    GroupSampler,
    OldestFirst,
    SimilarLength,
    TokenBalanced,
    TransferError,
    karmarkar_karp,
)

SPEC = ColumnSpec(torch.int64)
TASKS = ("rollout", "trainer")
COLUMN_SETS = (("prompt",), ("prompt", "response"), ("response",))


class ControllerMachine(RuleBasedStateMachine):
    """A model of which cells are ready and which rows each task received, checked on every request."""

    def __init__(self):
        super().__init__()
        self.ctrl = Controller(num_storage_units=3, tasks=TASKS)
        self.next_index = 0
        self.ready: dict[int, set[str]] = {}
        self.delivered: dict[str, set[int]] = {t: set() for t in TASKS}

    def _mark(self, rows, column):
        self.ctrl.mark_ready("p", rows, {column: SPEC}, {column: [r % 7 + 1 for r in rows]})
        for r in rows:
            self.ready[r].add(column)

    @rule(num=st.integers(1, 4), with_response=st.booleans())
    def append(self, num, with_response):
        rows = list(range(self.next_index, self.next_index + num))
        self.next_index += num
        with_prompt = {"prompt": SPEC}
        lengths = {"prompt": [r % 7 + 1 for r in rows]}
        self.ctrl.try_add_rows("p", rows, with_prompt, lengths, [None] * num, [None] * num, [{}] * num)
        self.ready.update({r: {"prompt"} for r in rows})
        if with_response:
            self._mark(rows, "response")

    @precondition(lambda self: any("response" not in c for c in self.ready.values()))
    @rule(data=st.data())
    def write_response(self, data):
        missing = sorted(r for r, c in self.ready.items() if "response" not in c)
        self._mark(data.draw(st.lists(st.sampled_from(missing), min_size=1, max_size=3, unique=True)), "response")

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def second_write_is_rejected_and_changes_nothing(self, data):
        row = data.draw(st.sampled_from(sorted(self.ready)))
        column = data.draw(st.sampled_from(sorted(self.ready[row])))
        fresh = [r for r, c in self.ready.items() if column not in c][:1]  # a valid cell in the same call
        before = self.ctrl.state_dict()
        with pytest.raises(FilledCellError, match=f"partition 'p' row {row} column '{column}'"):
            self.ctrl.mark_ready("p", fresh + [row], {column: SPEC}, {column: [1] * (len(fresh) + 1)})
        assert self.ctrl.state_dict() == before

    @rule(task=st.sampled_from(TASKS), columns=st.sampled_from(COLUMN_SETS), batch_size=st.integers(1, 5))
    def request(self, task, columns, batch_size):
        meta = self.ctrl.try_request("p", task, list(columns), batch_size)
        deliverable = [r for r, c in self.ready.items() if set(columns) <= c and r not in self.delivered[task]]
        if meta is None:
            assert len(deliverable) < batch_size
            return
        assert len(meta) == batch_size
        for row, unit, length in zip(meta.indices, meta.units, meta.lengths[columns[0]]):
            assert set(columns) <= self.ready[row], "delivered before its columns were ready"
            assert row not in self.delivered[task], "delivered twice"
            assert unit == row % 3 and length == row % 7 + 1
            self.delivered[task].add(row)

    @precondition(lambda self: any(self.delivered.values()))
    @rule(task=st.sampled_from(TASKS), data=st.data())
    def reset_some(self, task, data):
        if not self.delivered[task]:
            return
        rows = data.draw(st.lists(st.sampled_from(sorted(self.delivered[task])), max_size=3, unique=True))
        self.ctrl.reset("p", task, rows)
        self.delivered[task] -= set(rows)

    def teardown(self):
        """Complete the partition and drain it with acknowledgements: every row not yet delivered reaches each
        task exactly once, and the partition clears right after the last acknowledgement."""
        missing = [r for r, c in self.ready.items() if "response" not in c]
        if missing:
            self._mark(missing, "response")
        self.ctrl.seal("p")
        for task in TASKS:
            self.ctrl.ack("p", task, sorted(self.delivered[task]))
            got, last = [], []
            while meta := self.ctrl.request("p", task, ["prompt", "response"], 3, timeout=0, ack=last):
                got += meta.indices
                last = meta.indices
                assert len(got) <= len(self.ready), "rows delivered more than once"
            self.ctrl.ack("p", task, last)
            assert sorted(got) == sorted(set(self.ready) - self.delivered[task]), "rows lost or duplicated"
        assert self.ctrl.status("p") == {"exists": False, "cleared": "consumed"}


TestControllerMachine = ControllerMachine.TestCase
TestControllerMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 1000), max_size=30), k=st.integers(1, 6))
def test_karmarkar_karp_partitions_everything_with_spread_at_most_the_largest_item(lengths, k):
    parts = karmarkar_karp(lengths, k)
    assert len(parts) == k
    assert sorted(p for part in parts for p in part) == list(range(len(lengths)))
    sums = [sum(lengths[p] for p in part) for part in parts]
    assert max(sums) - min(sums) <= max(lengths, default=0)


def _controller_with_rows(lengths, group_ids=None, versions=None, ctrl=None):
    ctrl = ctrl or Controller()
    n = len(lengths)
    rows = list(range(100, 100 + n))
    ctrl.try_add_rows("p", rows, {"x": SPEC}, {"x": lengths}, group_ids or [None] * n, versions or [None] * n, [{}] * n)
    return ctrl, rows


def test_token_balanced_splits_a_batch_into_balanced_rank_parts():
    lengths = [900, 850, 100, 120, 90, 400, 30, 500]
    ctrl, rows = _controller_with_rows(lengths)
    meta = ctrl.try_request("p", "trainer", ["x"], 8, TokenBalanced(dp_size=2))
    per_rank = meta.split()
    assert len(per_rank) == 2 and sorted(i for m in per_rank for i in m.indices) == rows
    sums = [sum(m.lengths["x"]) for m in per_rank]
    naive = [sum(lengths[:4]), sum(lengths[4:])]
    assert abs(sums[0] - sums[1]) < abs(naive[0] - naive[1])
    assert abs(sums[0] - sums[1]) <= max(lengths)


def test_group_sampler_hands_out_only_complete_groups_oldest_first():
    ctrl, first = _controller_with_rows([1, 1, 1], [0, 0, 1], [0, 0, 1])  # group 0 of 2 done, group 1 half
    sampler = GroupSampler(group_size=2)
    assert ctrl.try_request("p", "t", ["x"], 4, sampler) is None  # only one complete group, need two
    meta = ctrl.try_request("p", "t", ["x"], 2, sampler)
    assert meta.indices == first[:2] and meta.group_ids == [0, 0]
    assert ctrl.try_request("p", "t", ["x"], 2, sampler) is None  # group 1 incomplete
    ctrl.seal("p")
    with pytest.raises(TransferError, match="cannot batch"):
        ctrl.try_request("p", "t", ["x"], 2, sampler)  # group 1 can never complete: a clear error, not a hang


def test_group_sampler_takes_group_size_from_the_partition():
    ctrl = Controller()
    ctrl.create_partition("p", group_size=3)
    ctrl, rows = _controller_with_rows([1, 2, 3], [5, 5, 5], ctrl=ctrl)
    assert ctrl.try_request("p", "t", ["x"], 3, GroupSampler()).indices == rows


def test_oldest_first_prefers_lower_weight_versions_and_similar_length_the_narrowest_window():
    ctrl, rows = _controller_with_rows([5, 5, 5, 5], versions=[3, 1, 2, 1])
    assert ctrl.try_request("p", "t", ["x"], 3, OldestFirst()).indices == [rows[1], rows[3], rows[2]]
    ctrl, rows = _controller_with_rows([10, 300, 12, 11, 200, 14])
    assert sorted(ctrl.try_request("p", "t", ["x"], 3, SimilarLength()).indices) == [rows[0], rows[2], rows[3]]


def test_reset_rearms_rows_behind_the_rows_still_pending():
    ctrl, rows = _controller_with_rows([1, 1, 1, 1])
    first = ctrl.try_request("p", "t", ["x"], 2)
    assert first.indices == rows[:2]
    ctrl.reset("p", "t", rows[:1])  # the worker holding row 0 failed
    assert ctrl.try_request("p", "t", ["x"], 3).indices == [rows[2], rows[3], rows[0]]
    assert ctrl.status("p")["consumed"] == {"t": 4}
    ctrl.reset("p")  # everything, for every task
    assert ctrl.try_request("p", "t", ["x"], 4).indices == rows


def test_release_rearms_only_the_unfinished_rows_a_dead_consumer_held():
    ctrl, rows = _controller_with_rows([1, 1, 1, 1])
    assert ctrl.try_request("p", "rollout", ["x"], 3, consumer="replica-0").indices == rows[:3]
    assert ctrl.try_request("p", "rollout", ["x"], 1, consumer="replica-1").indices == rows[3:]
    ctrl.mark_ready("p", rows[:1], {"y": SPEC}, {"y": [2]})  # replica-0 finished row 0, then died
    assert ctrl.release("rollout", "replica-0", ["y"]) == {"p": rows[1:3]}
    assert ctrl.release("rollout", "replica-0", ["y"]) == {}, "released rows are no longer held by it"
    assert ctrl.try_request("p", "rollout", ["x"], 2, consumer="replica-1").indices == rows[1:3]
    assert ctrl.status("p")["consumed"] == {"rollout": 4} and ctrl.metrics()["released/rollout"] == 2
