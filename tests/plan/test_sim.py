"""The simulator's pieces: its group choice equals `GroupSampler`'s, its two continuous-batching paths agree,
the staleness bound holds, sync / stream / async order as they must, and the shipped profiles load."""

import dataclasses

import numpy as np
import pytest

from asyncflow.models.logprobs import TrainSample
from asyncflow.models.tri_model import should_pack
from asyncflow.plan.costs import Costs, ModelShape, Profile, qwen_like
from asyncflow.plan.sim import (
    SimSpec,
    _queued_offsets,
    engine_micro_batches,
    generation_offsets,
    micro_batch_tokens,
    shared_host_stretch,
    simulate,
    take_groups,
)
from asyncflow.plan.workload import Lengths, Workload
from asyncflow.transfer.samplers import Candidate, GroupSampler
from asyncflow.workers.trainer import token_budget_micro_batches

COSTS = Costs(decode_step_s=0.01, decode_row_s=0.001, decode_row_token_s=1e-6, prefill_token_s=1e-4,
              train_micro_batch_s=0.01, train_token_s=1e-4, optimizer_step_s=0.05, publish_s=0.02, swap_s=0.01,
              prefill_row_s=5e-4, train_packed_token_s=1.5e-4)


def group_sampler_reads(done: np.ndarray, now: float, want: int, G: int, trainer_s: float) -> list[list[int]]:
    """What the real `GroupSampler` hands a trainer that asks at `now`, then every `trainer_s` after each read,
    given when each group's rows become ready: the queue's candidates at the time the read is served."""
    unread = set(range(len(done)))
    reads = []
    while unread:
        # served at the first time the sampler returns something (draining once every group is complete)
        for t in sorted({now, *[float(d) for d in done if d > now]}):
            cands = [Candidate(g * G + i, g, 0, 0) for g in sorted(unread) if done[g] <= t for i in range(G)]
            drain = all(done[g] <= t for g in unread)
            parts = GroupSampler().select(cands, want * G, drain, G)
            if parts:
                break
        groups = sorted({i // G for i in parts[0]})
        reads.append(groups)
        unread -= set(groups)
        now = t + trainer_s
    return reads


@pytest.mark.parametrize("seed", range(20))
def test_take_groups_equals_group_sampler(seed):
    rng = np.random.default_rng(seed)
    n, G, want = int(rng.integers(1, 12)), 4, int(rng.integers(1, 4))
    done = np.round(rng.uniform(0, 5, n), 1)
    now, trainer_s = float(rng.uniform(0, 3)), float(rng.uniform(0, 1.5))
    unread, reads, t = np.ones(n, dtype=bool), [], now
    while unread.any():
        taken, t = take_groups(done, unread, t, want)
        reads.append(sorted(taken.tolist()))
        t += trainer_s
    assert reads == group_sampler_reads(done, now, want, G, trainer_s)


def test_vectorised_and_queued_generation_agree():
    rng = np.random.default_rng(0)
    P = rng.integers(4, 40, (3, 10))
    L = rng.integers(1, 50, (3, 10))
    fast = generation_offsets(P, L, 16, COSTS)  # every row has a slot: the vectorised path
    context = float(P.mean() + L.mean() / 2)
    slow = np.stack([_queued_offsets(P[r], L[r], 16, COSTS, context) for r in range(3)])
    np.testing.assert_allclose(fast, slow, rtol=1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_a_token_budget_splits_a_read_as_the_trainer_does(seed):
    """Under `train.max_tokens_per_micro_batch` the simulated trainer runs the micro-batches the real one runs: as
    many, each packed (its groups' prompt once) exactly when the tri-model forward would pack it."""
    rng = np.random.default_rng(seed)
    G, groups = 4, int(rng.integers(1, 5))
    P = np.repeat(rng.integers(8, 48, groups), G)
    L = np.repeat(rng.integers(1, 24, groups), G)  # equal within a group: the sim's padded count is then exact
    budget = int(rng.integers(40, 400))
    simulated = engine_micro_batches(P, L, G, budget)
    real = token_budget_micro_batches((P + L).tolist(), [i // G for i in range(len(P))], budget, len(P))
    assert len(simulated) == len(real)
    for rows, (tokens, packed) in zip(real, simulated, strict=True):
        samples = [TrainSample([3] * int(P[i]), [5] * int(L[i]), i // G) for i in rows]
        assert packed == should_pack(samples), (rows, tokens)
        assert tokens <= len(rows) * (P[rows] + L[rows]).max()
    assert engine_micro_batches(P, L, G, None) == [micro_batch_tokens(P, L, G)]


def test_a_token_budget_costs_a_fixed_cost_per_micro_batch():
    P, L = np.full((6, 8), 36), np.full((6, 8), 8)
    spec = SimSpec(mode="async", prompt_lengths=P, response_lengths=L, group_size=4, costs=COSTS, max_staleness=1,
                   micro_batch_groups=2, timeline_replicas=1)
    whole = simulate(spec)
    split = simulate(dataclasses.replace(spec, max_tokens_per_micro_batch=128))  # 2 rows of 44 tokens each
    count = [sum(e["name"] == "train_micro_batch" for e in r.events) for r in (whole, split)]
    assert count == [6, 24]
    # 4 packed micro-batches of 2 rows (36 + 16 tokens) against one of 8 (2 x (36 + 32)): 3 more fixed costs
    expected = 3 * COSTS.train_micro_batch_s + (4 * 52 - 136) * COSTS.train_packed_token_s
    assert split.trainer_busy_s - whole.trainer_busy_s == pytest.approx(6 * expected, rel=1e-6)


@pytest.mark.parametrize("mode, k", [("sync", 0), ("stream", 0), ("async", 1), ("async", 3)])
def test_staleness_bound_and_every_row_trained(mode, k):
    w = Workload(prompts_per_step=8, group_size=4, prompt=Lengths(mean=16),
                 response=Lengths(kind="lognormal", mean=40, max=400))
    P, L = w.sample(30, seed=1)
    spec = SimSpec(mode=mode, prompt_lengths=P, response_lengths=L, group_size=4, costs=COSTS, max_staleness=k,
                   replicas=2, slots=8, micro_batch_groups=2)
    r = simulate(spec)
    assert (r.staleness >= 0).all() and (r.staleness <= k).all()
    assert np.all(np.diff(r.step_end_s) > 0)
    if mode != "sync":
        assert all(sorted(o) == list(range(8)) for o in r.trained_order)


def test_async_beats_sync_on_a_long_tail_and_stream_sits_between():
    hw = Profile.load("h100")
    model = qwen_like("7B")
    w = Workload(prompts_per_step=64, group_size=8, prompt=Lengths(mean=512),
                 response=Lengths(kind="lognormal", mean=2000, sigma=1.0, max=16384))
    P, L = w.sample(12)
    sep = Costs.from_profile(hw, model, train_devices=32)
    colo = Costs.from_profile(hw, model, train_devices=64)
    times = {}
    for mode, k in [("sync", 0), ("stream", 0), ("async", 1), ("async", 2)]:
        spec = SimSpec(mode=mode, prompt_lengths=P, response_lengths=L, group_size=8, costs=sep, sync_costs=colo,
                       max_staleness=k, replicas=32, sync_replicas=64, micro_batch_groups=8)
        times[mode, k] = simulate(spec).step_time()
    assert times["async", 2] <= times["async", 1] < times["stream", 0]
    assert times["async", 1] < times["sync", 0]


def test_a_shared_host_slows_overlapped_roles_by_what_the_runtime_leaves_them():
    balanced = dataclasses.replace(COSTS, train_token_s=1e-3, train_packed_token_s=None, queue_beside_call_s=0.005)
    shared = dataclasses.replace(balanced, host_cores=2, background_cores=0.2)
    # two roles on two cores, 0.2 + 0.2 of them taken by the runtime and the data plane: each role gets 0.8
    assert shared_host_stretch(shared, replicas=1, queue_cpu_per_s=0.2) == pytest.approx(1.25)
    assert shared_host_stretch(balanced, replicas=1, queue_cpu_per_s=0.2) == 1.0  # each role on its own devices
    assert shared_host_stretch(dataclasses.replace(shared, host_cores=8), replicas=1, queue_cpu_per_s=0.2) == 1.0
    P, L = Workload(prompts_per_step=8, group_size=4, prompt=Lengths(mean=8), response=Lengths(mean=16)).sample(8)
    runs = {}
    for costs in (balanced, shared):
        for mode in ("sync", "async"):
            spec = SimSpec(mode=mode, prompt_lengths=P, response_lengths=L, group_size=4, costs=costs, slots=32)
            runs[mode, costs.host_cores] = simulate(spec)
    assert runs["sync", 2].step_time() == runs["sync", 0].step_time()  # one role at a time: nothing to share
    # both roles busy ~85% of the time: slower by most of the stretch, never by more
    alone, shared_run = runs["async", 0], runs["async", 2]
    s = shared_host_stretch(shared, 1, shared_run.queue_cpu_s / shared_run.total_s)
    assert min(alone.busy().values()) > 0.75
    assert alone.step_time() * (1 + 0.7 * (s - 1)) < shared_run.step_time() < alone.step_time() * s


def test_shipped_profiles_are_spec_derived_and_shapes_load(tmp_path):
    for name in ("h100", "a100", "910b"):
        p = Profile.load(name)
        assert p.kind == "spec" and p.hardware.peak_flops > 1e14
    shape = ModelShape.from_hf_config({"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                                       "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064})
    assert 7.0e9 < shape.params < 8.0e9  # Qwen2.5-7B: 7.6B
    p = Profile(kind="measured", name="x", decode_step_s=0.01)
    assert Profile.load(p.save(tmp_path / "p.yaml")) == p
    assert Profile.load(p.save(tmp_path / "p.json")) == p


def test_rolling_updates_are_never_slower_than_a_global_barrier():
    w = Workload(prompts_per_step=16, group_size=4, prompt=Lengths(mean=16),
                 response=Lengths(kind="lognormal", mean=40, max=400))
    P, L = w.sample(20, seed=3)
    spec = SimSpec(mode="async", prompt_lengths=P, response_lengths=L, group_size=4, costs=COSTS, max_staleness=1,
                   replicas=4, slots=8, micro_batch_groups=2)
    rolling = simulate(spec)
    lockstep = simulate(SimSpec(**{**spec.__dict__, "lockstep": True}))
    assert (lockstep.staleness <= 1).all()
    assert rolling.step_time() <= lockstep.step_time() + 1e-9


@pytest.mark.parametrize(("mean", "top"), [(7.86, 8), (14.0, 64), (4.0, 8), (900.0, 4000)])
def test_truncated_geometric_lengths_have_the_measured_mean(mean, top):
    """A run measures the mean of lengths already cut at max_new_tokens; the workload must reproduce it."""
    lengths = Lengths.truncated_geometric(mean, top).sample(400_000, np.random.default_rng(0))
    assert lengths.max() <= top and abs(lengths.mean() / mean - 1) < 0.01
    assert Lengths.truncated_geometric(8.0, 8).kind == "fixed"
