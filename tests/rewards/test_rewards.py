"""Tests for asyncflow.rewards: verifiers, registry/spec resolution, and the fault-tolerant runner."""

import logging
import math
import threading
import time

import pytest

from asyncflow.rewards import (
    REWARDS,
    CompositeReward,
    RewardRunner,
    RewardSpecError,
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
    assert sum("non-finite" in m for m in messages) == 1


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
    assert 0.2 <= elapsed < 2.0


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
