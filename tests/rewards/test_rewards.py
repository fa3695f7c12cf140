"""Tests for asyncflow.rewards: verifiers, registry/spec resolution, and the fault-tolerant runner."""

import logging
import math
import os
import threading
import time

import pytest

from asyncflow.rewards import (
    REWARDS,
    CompositeReward,
    RewardFailure,
    RewardHealth,
    RewardHealthError,
    RewardRunner,
    RewardSpecError,
    RewardStuckError,
    answer_tag_match,
    exact_match,
    extract_numbers,
    extract_tag,
    format_reward,
    math_verify,
    numeric_match,
    register_reward,
    resolve_reward,
)
from asyncflow.rewards.health import counter_growth


# ---------------------------------------------------------------- verifiers
def test_exact_match_strips_whitespace():
    assert exact_match(" 42\n", "42") == 1.0
    assert exact_match("42", "43") == 0.0


def test_extract_numbers_formats():
    assert extract_numbers("x = -3, y = 3.0 and 1,000 apples") == [-3.0, 3.0, 1000.0]
    assert extract_tag("<answer>1</answer> then <answer> 2 </answer>") == "2"  # the last one
    assert extract_tag("no tags") is None


def test_numeric_match():
    assert numeric_match("The total is 1,000.", "1000") == 1.0  # comma thousands, trailing period
    assert numeric_match("so x = 3.0", "3") == 1.0
    assert numeric_match("first -3, then 5", "-3", position="first") == 1.0
    assert numeric_match("first -3, then 5", "-3") == 0.0  # default: the last number (5)
    assert numeric_match("0.3333333", "0.333333333") == 1.0  # |diff| / 0.33 ~ 1e-7 < rel_tol 1e-6
    assert numeric_match("no number here", "7") == 0.0
    with pytest.raises(ValueError, match="not a single number"):
        numeric_match("7", "seven")
    with pytest.raises(ValueError, match="position must be"):
        numeric_match("7", "7", position="middle")


def test_math_verify_equivalence():
    assert math_verify("so the answer is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_verify("The answer is 0.5", "\\frac{1}{2}") == 1.0
    assert math_verify("\\boxed{3}", "4") == 0.0
    assert math_verify("I do not know", "0.5") == 0.0


def test_format_reward():
    assert format_reward("<think>hm</think>\n<answer>5\n</answer>", "") == 1.0  # spans lines
    assert format_reward("5", "") == 0.0
    assert format_reward("Final: 5", "", pattern=r"^Final: \d+$") == 1.0


def test_answer_tag_match():
    assert answer_tag_match("work... <answer> 1,000 </answer>", "1000") == 1.0  # numeric ground truth
    assert answer_tag_match("<answer>Paris</answer>", "Paris") == 1.0  # text ground truth -> exact
    assert answer_tag_match("<answer>Lyon</answer>", "Paris") == 0.0
    assert answer_tag_match("1000", "1000") == 0.0  # no tag -> 0
    assert answer_tag_match("<answer>7</answer><answer>8</answer>", "8") == 1.0  # last tag wins


# ---------------------------------------------------------------- registry
@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_user_rewards.py").write_text(
        "CONST = 3\n"
        "def length_reward(completion, ground_truth, **metadata):\n"
        "    return len(completion) * metadata.get('scale', 1.0)\n"
        "def hang_or_length(completion, ground_truth, **metadata):\n"
        "    if completion == 'hang':\n"
        "        import time; time.sleep(3600)\n"
        "    return len(completion)\n"
        "def crash_on_crash(completion, ground_truth, **metadata):\n"
        "    if completion == 'crash':\n"
        "        import os; os._exit(3)\n"
        "    return 0.0\n"
        "class Scorer:\n"
        "    @staticmethod\n"
        "    def score(completion, ground_truth, **metadata):\n"
        "        return 2.0\n"
    )
    (tmp_path / "broken_user_rewards.py").write_text("import not_a_real_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_user_rewards"


def test_resolve_builtin_and_user_specs(user_module):
    assert resolve_reward("math_verify") is math_verify
    assert set(REWARDS) >= {"exact_match", "numeric_match", "math_verify", "format_reward", "answer_tag_match"}
    fn = resolve_reward(f"{user_module}:length_reward")
    assert fn("abcd", "", scale=0.5) == 2.0  # 4 chars * 0.5
    assert resolve_reward(f"{user_module}:Scorer.score")("x", "") == 2.0
    assert resolve_reward(exact_match) is exact_match


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such_reward", "unknown reward 'no_such_reward'"),
        ("", "non-empty string"),
        (":f", "must look like 'package.module:function'"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("broken_user_rewards:f", "cannot import module 'broken_user_rewards'"),
        ("my_user_rewards:missing", "has no attribute 'missing'"),
        ("my_user_rewards:CONST", "'CONST' is a int, not callable"),
    ],
)
def test_bad_specs_raise_clear_errors(user_module, spec, message):
    with pytest.raises(RewardSpecError, match=message):
        resolve_reward(spec)


def test_register_reward_and_duplicates():
    try:
        @register_reward("test_const_one")
        def const_one(completion, ground_truth, **metadata):
            return 1.0

        assert resolve_reward("test_const_one") is const_one
        with pytest.raises(ValueError, match="already registered"):
            register_reward("test_const_one")(exact_match)
    finally:
        REWARDS.pop("test_const_one", None)
    with pytest.raises(ValueError, match="without ':'"):
        register_reward("a:b")


def test_composite_reward_weighted_sum():
    reward = CompositeReward([(exact_match, 0.5), ("format_reward", 2.0)])
    # exact (1.0 * 0.5) + format (1.0 * 2.0) = 2.5 ; wrong answer, right format -> 2.0
    assert reward("<answer>1</answer>", "<answer>1</answer>") == 2.5
    assert reward("<answer>2</answer>", "<answer>1</answer>") == 2.0
    with pytest.raises(ValueError, match="at least one"):
        CompositeReward([])
    with pytest.raises(ValueError, match="finite number"):
        CompositeReward([(exact_match, math.nan)])


# ---------------------------------------------------------------- runner
def test_runner_counts_errors_and_warns_once(caplog):
    def picky(completion, ground_truth, **metadata):
        if ground_truth == "boom":
            raise RuntimeError("bad sample")
        if ground_truth == "nan":
            return math.nan
        return float(completion == ground_truth) * metadata.get("scale", 1.0)

    runner = RewardRunner(picky, timeout_s=5.0, max_workers=2)
    with caplog.at_level(logging.WARNING, logger="asyncflow.rewards.runner"):
        result = runner.score(["a", "x", "x", "b", "x"], ["a", "boom", "boom", "b", "nan"],
                              [{}, {}, {}, {"scale": 3.0}, {}])
    assert result.rewards == [1.0, 0.0, 0.0, 3.0, 0.0]
    assert (result.n_errors, result.n_timeouts) == (3, 0)  # two raises + one NaN
    messages = [r.getMessage() for r in caplog.records]
    assert sum("RuntimeError: bad sample" in m for m in messages) == 1  # once per kind
    assert sum("returned nan (float), which is not a reward" in m for m in messages) == 1


def test_runner_timeout_abandons_hung_thread_without_starving():
    release = threading.Event()

    def maybe_hang(completion, ground_truth, **metadata):
        if completion == "hang":
            release.wait(30)
        return 1.0

    runner = RewardRunner(maybe_hang, timeout_s=0.2, max_workers=2)
    start = time.monotonic()
    try:
        # both worker slots first get hung samples; after 0.2 s they are abandoned and the
        # remaining samples still run
        result = runner.score(["hang", "hang", "ok", "ok"], ["", "", "", ""])
    finally:
        release.set()
    elapsed = time.monotonic() - start
    assert result.rewards == [0.0, 0.0, 1.0, 1.0]
    assert (result.n_errors, result.n_timeouts) == (0, 2)
    assert 0.2 <= elapsed < 15, "the hung calls are abandoned at 0.2 s, not after their 30 s"


def test_runner_with_user_spec_and_math_verify_off_main_thread(user_module):
    runner = RewardRunner([("math_verify", 1.0), (f"{user_module}:length_reward", 0.1)], timeout_s=20.0)
    # math_verify runs in a worker thread: works only because its signal timeouts are disabled
    # sample 0: 1.0 + 0.1 * len("\boxed{\frac{1}{2}}") = 1.0 + 0.1 * 19 ; sample 1: 0.0 + 0.1 * 9
    completions = ["\\boxed{\\frac{1}{2}}", "\\boxed{3}"]
    result = runner.score(completions, ["0.5", "4"], None)
    assert (result.n_errors, result.n_timeouts) == (0, 0)
    assert result.rewards == pytest.approx([1.0 + 0.1 * 19, 0.1 * 9])


def test_runner_rejects_bad_arguments():
    with pytest.raises(ValueError, match="equal lengths"):
        RewardRunner(exact_match).score(["a"], ["a", "b"])
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        RewardRunner(exact_match, timeout_s=0)
    with pytest.raises(ValueError, match="max_workers"):
        RewardRunner(exact_match, max_workers=0)
    with pytest.raises(RewardSpecError, match="unknown reward"):
        RewardRunner("nope")
    assert RewardRunner("exact_match").score([], [], []).rewards == []


# ---------------------------------------------------------------- issue 15, item 5: what a reward may return
def _const(value):
    def reward(completion, ground_truth, **metadata):
        return value

    return reward


@pytest.mark.parametrize("value", [None, "1.0", "abc", math.nan, math.inf, -math.inf, [1.0], b"1", 10 ** 400])
def test_a_reward_that_is_not_a_finite_number_is_an_error_named_in_a_warning(caplog, value):
    runner = RewardRunner(_const(value), timeout_s=5.0, max_workers=2)
    with caplog.at_level(logging.WARNING, logger="asyncflow.rewards.runner"):
        result = runner.score(["a", "b"], ["a", "b"])
    assert result.rewards == [0.0, 0.0]
    assert (result.n_errors, result.n_timeouts) == (2, 0)
    [message] = [r.getMessage() for r in caplog.records]  # once per function and kind
    assert "_const.<locals>.reward" in message and "sample 0" in message  # the function and the first sample
    assert f"returned {value!r}"[:60] in message and "not a reward" in message  # the offending value
    assert runner.last_failure is not None and "not a reward" in runner.last_failure


def test_numbers_of_every_kind_are_rewards():
    np = pytest.importorskip("numpy")
    from fractions import Fraction

    for value, expected in [(0.5, 0.5), (2, 2.0), (True, 1.0), (False, 0.0), (np.float32(0.25), 0.25),
                            (np.int64(3), 3.0), (np.bool_(True), 1.0), (Fraction(1, 4), 0.25)]:
        result = RewardRunner(_const(value)).score(["a"], ["a"])
        assert (result.rewards, result.n_errors) == ([expected], 0), value


def test_composite_reward_names_the_component_that_returned_a_string(caplog):
    def as_text(completion, ground_truth, **metadata):
        return "1.0"

    runner = RewardRunner([("exact_match", 1.0), (as_text, 0.5)])
    with caplog.at_level(logging.WARNING, logger="asyncflow.rewards.runner"):
        result = runner.score(["a"], ["a"])
    assert (result.rewards, result.n_errors) == ([0.0], 1)
    [message] = [r.getMessage() for r in caplog.records]
    assert "as_text" in message and "returned '1.0' (str)" in message
    with pytest.raises(RewardFailure, match="as_text"):  # called directly, the composite raises
        CompositeReward([(exact_match, 1.0), (as_text, 1.0)])("a", "a")


# ---------------------------------------------------------------- issue 15, item 7: the spec checked up front
def test_check_reward_specs_resolves_and_checks_signatures_without_calling(user_module):
    from asyncflow.rewards import check_reward_specs

    calls = []

    def never_called(completion, ground_truth, **metadata):
        calls.append(1)
        return 1.0

    pairs = check_reward_specs(["numeric_match", f"{user_module}:length_reward", never_called], [1.0, 0.1, 2])
    assert [w for _, w in pairs] == [1.0, 0.1, 2.0] and pairs[0][0] is numeric_match and not calls

    def no_metadata(completion, ground_truth):
        return 1.0

    def one_argument(completion, **metadata):
        return 1.0

    def extra_required(completion, ground_truth, scale, **metadata):
        return 1.0

    for fn, message in [(no_metadata, r"without \*\*metadata"), (one_argument, "cannot be called as"),
                        (extra_required, "missing a required argument: 'scale'")]:
        with pytest.raises(RewardSpecError, match=message) as err:
            check_reward_specs([fn])
        assert fn.__name__ in str(err.value)
    with pytest.raises(RewardSpecError, match="2 reward weights for 1 reward functions"):
        check_reward_specs(["exact_match"], [1.0, 2.0])
    with pytest.raises(RewardSpecError, match="weight must be a finite number"):
        check_reward_specs(["exact_match"], [math.inf])
    with pytest.raises(RewardSpecError, match="no reward function"):
        check_reward_specs([])
    with pytest.raises(RewardSpecError, match="cannot import module"):
        check_reward_specs(["broken_user_rewards:f"])
    with pytest.raises(RewardSpecError, match="cannot be sent to a worker process"):
        check_reward_specs([never_called], isolation="process")  # a local function cannot be pickled
    with pytest.raises(RewardSpecError, match="without \\*\\*metadata"):  # the runner applies the same check
        RewardRunner(no_metadata)


# ---------------------------------------------------------------- issue 15, item 5: timeouts leak nothing
def test_hung_reward_calls_do_not_leak_a_thread_each():
    release = threading.Event()

    def hang(completion, ground_truth, **metadata):
        release.wait(60)
        return 1.0

    runner = RewardRunner(hang, timeout_s=0.05, max_workers=2)  # default bound: 8 stuck calls
    baseline = threading.active_count()
    timed_out = 0
    try:
        for _ in range(10):  # up to 40 timed-out samples: the old runner left a thread behind for each
            try:
                timed_out += runner.score(["x"] * 4, [""] * 4).n_timeouts
            except RuntimeError as err:  # RewardStuckError: the bound is reached, the run would stop here
                assert "reward.max_stuck_calls=8" in str(err)
                break
            assert threading.active_count() - baseline <= 2 + 8
        assert timed_out == 8 and threading.active_count() - baseline <= 2 + 8
    finally:
        release.set()


def test_concurrent_score_calls_share_the_pool():  # training and evaluation may score at the same time
    runner = RewardRunner("numeric_match", max_workers=3)
    results = {}

    def score(name, offset):
        completions = [str(i + offset) for i in range(400)]
        results[name] = runner.score(completions, [str(i) for i in range(400)])

    threads = [threading.Thread(target=score, args=(name, offset)) for name, offset in (("same", 0), ("off", 1))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results["same"].rewards == [1.0] * 400 and results["off"].rewards == [0.0] * 400


def test_thread_timeouts_keep_the_thread_count_bounded_then_stop_with_a_clear_error():
    release = threading.Event()

    def hang_on_hang(completion, ground_truth, **metadata):
        if completion == "hang":
            release.wait(60)
        return 1.0

    workers, max_stuck = 2, 4
    runner = RewardRunner(hang_on_hang, timeout_s=0.05, max_workers=workers, max_stuck_calls=max_stuck)
    baseline = threading.active_count()
    timed_out, peak = 0, 0
    try:
        with pytest.raises(RewardStuckError) as err:
            for _ in range(20):  # 20 batches x 2 hung samples: the old runner held 40 threads
                result = runner.score(["hang", "ok", "hang", "ok"], ["", "", "", ""])
                assert result.rewards == [0.0, 1.0, 0.0, 1.0]
                timed_out += result.n_timeouts
                peak = max(peak, threading.active_count() - baseline)
        peak = max(peak, threading.active_count() - baseline)
        assert timed_out == max_stuck  # the next timeout would have needed one thread too many
        assert peak <= workers + max_stuck
        message = str(err.value)
        assert "hang_on_hang" in message and "reward.max_stuck_calls=4" in message and "isolation=process" in message
    finally:
        release.set()
    deadline = time.monotonic() + 5
    while runner.stuck_calls and time.monotonic() < deadline:  # stuck threads that return exit
        time.sleep(0.01)
    assert runner.stuck_calls == 0
    runner.close()


@pytest.mark.slow
def test_slow_but_finite_calls_return_their_threads():
    def slow_sometimes(completion, ground_truth, **metadata):
        if completion == "slow":
            time.sleep(0.15)
        return 1.0

    runner = RewardRunner(slow_sometimes, timeout_s=0.05, max_workers=2, max_stuck_calls=4)
    baseline = threading.active_count()
    timeouts = 0
    for _ in range(10):  # 20 timed-out samples in all, never more than 4 stuck at once
        result = runner.score(["slow", "ok", "ok", "slow"] + ["ok"] * 4, [""] * 8)
        timeouts += result.n_timeouts
        assert threading.active_count() - baseline <= 2 + 4
        time.sleep(0.2)  # the slow calls end meanwhile
    assert timeouts == 20 and runner.stuck_calls == 0


def _child_pids() -> set[int]:
    pids = set()
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            try:
                with open(f"/proc/{stat}/stat") as file:
                    fields = file.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid():
                pids.add(int(stat))
    return pids


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="counts child processes through /proc")
@pytest.mark.slow
def test_process_isolation_kills_hung_calls_and_leaks_nothing(user_module):
    before_threads, before_children = threading.active_count(), _child_pids()
    runner = RewardRunner(f"{user_module}:hang_or_length", timeout_s=0.5, max_workers=2, isolation="process")
    timeouts = 0
    for _ in range(3):
        result = runner.score(["hang", "ab", "hang", "abc", "hang", "a"], [""] * 6)
        assert result.rewards == [0.0, 2.0, 0.0, 3.0, 0.0, 1.0]
        assert result.n_errors == 0
        timeouts += result.n_timeouts
        assert threading.active_count() == before_threads
        assert len(_child_pids() - before_children) <= 2
    assert timeouts == 9 and runner._pool.kills == 9
    runner.close()
    assert _child_pids() - before_children == set()


def test_process_isolation_scores_like_threads_and_survives_a_crashing_worker(user_module):
    completions = ["the answer is 12", "13", "no number", "crash", "1,000"]
    truths = ["12", "12", "5", "1", "1000"]
    metadatas = [{"answer": t, "sample_index": i} for i, t in enumerate(truths)]
    runner = RewardRunner([("numeric_match", 1.0), (f"{user_module}:crash_on_crash", 1.0)], isolation="process",
                          max_workers=2)
    result = runner.score(completions, truths, metadatas)
    assert result.rewards == [1.0, 0.0, 0.0, 0.0, 1.0]
    [(index, failure)] = result.failures
    assert (index, failure.kind, result.n_errors) == (3, "died", 1)
    threads = RewardRunner([("numeric_match", 1.0), (f"{user_module}:crash_on_crash", 1.0)]).score(
        [c for c in completions if c != "crash"], [t for c, t in zip(completions, truths) if c != "crash"])
    assert threads.rewards == [1.0, 0.0, 0.0, 1.0]
    runner.close()


def test_process_isolation_reports_a_function_its_workers_cannot_load(user_module, tmp_path):
    import importlib
    import sys

    (tmp_path / "vanishing_rewards.py").write_text("def f(completion, ground_truth, **metadata):\n    return 1.0\n")
    importlib.import_module("vanishing_rewards")
    sys.path.remove(str(tmp_path))  # importable here (already imported), not in a fresh worker
    try:
        runner = RewardRunner("vanishing_rewards:f", isolation="process", max_workers=1)
        with pytest.raises(RewardSpecError, match="cannot be loaded in a worker process"):
            runner.score(["a"], ["a"])
    finally:
        sys.path.insert(0, str(tmp_path))
        sys.modules.pop("vanishing_rewards", None)


# ---------------------------------------------------------------- issue 15, item 5: the error-rate limit
def test_a_reward_that_raises_on_every_sample_ends_the_run_after_the_configured_steps():
    from asyncflow.config import load_config

    config = load_config(None).reward
    assert (config.max_error_fraction, config.max_error_steps) == (0.5, 3)  # on by default
    health = RewardHealth(config.max_error_fraction, config.max_error_steps)

    def always_raises(completion, ground_truth, **metadata):
        raise KeyError("solution")

    runner = RewardRunner(always_raises)
    with pytest.raises(RewardHealthError) as err:
        for step in range(1, 10):
            result = runner.score(["a"] * 8, ["a"] * 8)
            health.check(step, samples=8, errors=result.n_errors, timeouts=result.n_timeouts,
                         detail=runner.last_failure)
    assert step == 3
    message = str(err.value)
    for fragment in ("more than 0.5 of the samples for 3 steps in a row", "8 of 8 failed", "always_raises",
                     "KeyError", "reward.max_error_fraction", "reward.max_error_steps"):
        assert fragment in message


def test_reward_health_streak_threshold_reset_and_disable():
    health = RewardHealth(0.5, 3)
    health.check(1, samples=10, errors=6, timeouts=0)
    health.check(2, samples=10, errors=3, timeouts=3)
    assert health.streak == 2
    health.check(3, samples=10, errors=5, timeouts=0)  # exactly half: not more than half
    assert health.streak == 0
    health.check(4, samples=0, errors=0, timeouts=0)  # no samples: no change
    for step in (5, 6):
        health.check(step, samples=4, errors=0, timeouts=4)
    with pytest.raises(RewardHealthError, match=r"step 7: 3 of 4 failed, 1 errors and 2 timeouts"):
        health.check(7, samples=4, errors=1, timeouts=2)
    for off in (RewardHealth(0, 3), RewardHealth(None, 3), RewardHealth(0.5, 0), RewardHealth(0.5, None)):
        for step in range(10):
            off.check(step, samples=4, errors=4, timeouts=0)
    with pytest.raises(ValueError):
        RewardHealth(1.5, 3)


def test_counter_growth_counts_a_restarted_counter_from_zero():
    assert counter_growth(8, 2) == 6
    assert counter_growth(2, 2) == 0
    assert counter_growth(3, 8) == 3  # the scorer restarted: it counted 3 since


# ---------------------------------------------------------------- the reward worker's counters
def test_reward_worker_counts_training_and_evaluation_failures_apart():
    from types import SimpleNamespace

    from asyncflow.workers.reward import RewardWorker

    class Chars:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    def fails_on_x(completion, ground_truth, **metadata):
        if completion == "x":
            raise ValueError("x")
        return 1.0

    worker = RewardWorker(RewardRunner(fails_on_x), Chars())
    rewards = worker.score_ids([[ord("x")], [ord("y")]], [{"answer": "1"}, {"answer": "2"}])
    assert rewards.tolist() == [0.0, 1.0] and (worker.samples, worker.errors, worker.timeouts) == (2, 1, 0)
    rollouts = [SimpleNamespace(response_ids=[ord("x")], answer="1", metadata={}, reward=None, response_text=None)]
    worker.score(rollouts)
    assert (worker.errors, worker.eval_errors) == (1, 1) and rollouts[0].reward == 0.0
    assert "fails_on_x" in worker.last_failure
