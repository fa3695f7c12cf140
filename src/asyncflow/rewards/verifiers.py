"""Built-in rule-based reward functions (verifiers).

Owns: reward functions with ONE signature, `fn(completion: str, ground_truth: str, **metadata)
-> float`, plus the small text helpers they use (`extract_numbers`, `extract_tag`).
Invariants:
- A wrong or unparseable *completion* scores 0.0; it never raises.
- A ground truth the verifier cannot use (e.g. no number for `numeric_match`) raises
  `ValueError`: that is a data error, and the reward runner counts it as one.
- Unknown metadata keys are ignored, so one metadata dict can feed several verifiers.
- `math_verify` imports the `math-verify` package lazily and calls it with its signal-based
  timeouts disabled (they only work on the main thread); `RewardRunner` supplies the timeout.
"""

from __future__ import annotations

import math
import re

# integers, "1,000"-style thousands, decimals, exponents; optional sign
_NUMBER = re.compile(r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")

DEFAULT_FORMAT_PATTERN = r"<answer>.*?</answer>"


def _to_float(token: str) -> float:
    return float(token.replace(",", ""))


def extract_numbers(text: str) -> list[float]:
    """All numbers in `text`, in order: "-3" -> -3.0, "3.0" -> 3.0, "1,000" -> 1000.0."""
    return [_to_float(m.group(0)) for m in _NUMBER.finditer(text)]


def _parse_ground_truth_number(ground_truth: str) -> float:
    text = ground_truth.strip().strip("$").strip()
    if _NUMBER.fullmatch(text):
        return _to_float(text)
    numbers = extract_numbers(text)
    if len(numbers) != 1:
        raise ValueError(f"ground truth {ground_truth!r} is not a single number")
    return numbers[0]


def extract_tag(text: str, tag: str = "answer") -> str | None:
    """Content of the LAST `<tag>...</tag>` in `text` (stripped), or None if there is none."""
    found = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return found[-1].strip() if found else None


def exact_match(completion: str, ground_truth: str, **metadata) -> float:
    """1.0 if completion and ground truth are equal after stripping surrounding whitespace."""
    return 1.0 if completion.strip() == ground_truth.strip() else 0.0


def numeric_match(
    completion: str,
    ground_truth: str,
    *,
    position: str = "last",
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-9,
    **metadata,
) -> float:
    """1.0 if the first/last (`position`) number in the completion equals the ground-truth number
    within math.isclose(rel_tol, abs_tol). No number in the completion -> 0.0."""
    if position not in ("first", "last"):
        raise ValueError(f"position must be 'first' or 'last', got {position!r}")
    target = _parse_ground_truth_number(ground_truth)
    numbers = extract_numbers(completion)
    if not numbers:
        return 0.0
    answer = numbers[0] if position == "first" else numbers[-1]
    return 1.0 if math.isclose(answer, target, rel_tol=rel_tol, abs_tol=abs_tol) else 0.0


def math_verify(completion: str, ground_truth: str, **metadata) -> float:
    """1.0 if `math-verify` judges the completion's answer (its last \\boxed{} or, failing that,
    the answer expression it finds) equivalent to the ground truth (LaTeX or plain, e.g. "0.5",
    "\\frac{1}{2}"). Raises ValueError if the ground truth cannot be parsed."""
    import math_verify as mv  # lazy: sympy + latex2sympy are heavy to import

    gold = []
    for candidate in (ground_truth, f"${ground_truth}$", f"\\boxed{{{ground_truth}}}"):
        gold = mv.parse(candidate, parsing_timeout=None)
        if gold:
            break
    if not gold:
        raise ValueError(f"math_verify cannot parse ground truth {ground_truth!r}")
    answer = mv.parse(completion, parsing_timeout=None)
    if not answer:
        return 0.0
    return 1.0 if mv.verify(gold, answer, timeout_seconds=None) else 0.0


def format_reward(completion: str, ground_truth: str = "", *, pattern: str = DEFAULT_FORMAT_PATTERN,
                  **metadata) -> float:
    """1.0 if regex `pattern` is found in the completion (re.DOTALL), else 0.0. The ground truth
    is ignored. Default pattern: an `<answer>...</answer>` block."""
    return 1.0 if re.search(pattern, completion, flags=re.DOTALL) else 0.0


def answer_tag_match(completion: str, ground_truth: str, *, tag: str = "answer", rel_tol: float = 1e-6,
                     abs_tol: float = 1e-9, **metadata) -> float:
    """Extract the last `<tag>...</tag>` of the completion (none -> 0.0), then compare: numerically
    (its last number, like `numeric_match`) if the ground truth is a number, else `exact_match`."""
    answer = extract_tag(completion, tag)
    if answer is None:
        return 0.0
    try:
        _parse_ground_truth_number(ground_truth)
    except ValueError:
        return exact_match(answer, ground_truth)
    return numeric_match(answer, ground_truth, rel_tol=rel_tol, abs_tol=abs_tol)
