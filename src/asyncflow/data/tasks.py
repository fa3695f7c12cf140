"""Built-in procedurally generated, verifiable tasks for training tiny models from scratch.

Owns: the `Task` base class, the tasks `arithmetic`, `reverse`, `sort`, `countdown` and `tool_arithmetic`, the
registry `TASKS` / `make_task` (which also opens reasoning-gym's datasets, `reasoning_gym.py`), the countdown
verifier `countdown_reward`, `TASK_ALPHABET`, and the fixed prompt partition (`is_held_out`, `is_validation`,
`carve_validation` for data files).

Splits:
- train is an infinite stream drawn with replacement (duplicates happen) from a generator seeded
  by (task, difficulty, seed); `examples("train", n)` is its first n items, `iter_train()` the
  whole stream.
- test is a fixed list of distinct prompts drawn from a second seeded stream; by default its
  first `TEST_SIZE` items, fewer when the task has fewer distinct held-out prompts.
- validation is built the same way from a third stream (default `VALIDATION_SIZE` items): what the
  SFT warm-up measures to decide when to stop, so the test split stays unseen by every choice.

Invariants:
- Deterministic: the same (task, difficulty, seed) gives the same examples in every process
  (`random.Random` seeded with a string, which does not depend on PYTHONHASHSEED).
- The three splits never overlap: a hash of the prompt text falls in 0..99; below
  `HELD_OUT_PERCENT` the prompt is held out (test), in the next `VALIDATION_PERCENT` it is a
  validation prompt, otherwise a train prompt; each split takes only its own prompts. The partition
  ignores the seed, so no seed's train set contains any seed's test or validation prompt.
- Every prompt and every correct completion (answers; for countdown, the solution expression)
  uses only characters of `TASK_ALPHABET`. The countdown ground truth is JSON
  (`{"target":22,"numbers":[3,5,7]}`): it is read by `countdown_reward`, not emitted by the model.
- Every countdown instance is solvable: its target is computed from a random expression that
  uses every number once, kept in `metadata["solution"]`.
- `countdown_reward` never raises on a completion (anything unusable scores 0.0); a malformed
  ground truth raises ValueError, like the verifiers in `asyncflow.rewards`.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import itertools
import json
import operator
import random
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar

from asyncflow.data.records import Example

TEST_SIZE = 256
VALIDATION_SIZE = 256
HELD_OUT_PERCENT = 10
VALIDATION_PERCENT = 5
SPLITS = ("train", "validation", "test")
# a held-out stream that draws this many times in a row without a new prompt is exhausted
_EXHAUSTION_DRAWS = 5_000
_TRAIN_PREFIXES: dict[str, list[Example]] = {}  # task label -> the first examples of its train stream
_KEYWORDS = ("rev", "sort")
TASK_ALPHABET = "".join(sorted(set("0123456789+-*/=:,>()" + "".join(_KEYWORDS))))

_EXPRESSION_CHARS = frozenset("0123456789+-*/() ")
_MAX_EXPRESSION_CHARS = 200  # bounds parsing work (and nesting depth) on arbitrary completions
_BINARY_OPERATORS: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
}


def _bucket(prompt: str) -> int:
    digest = hashlib.blake2b(prompt.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 100


def is_held_out(prompt: str) -> bool:
    """Whether `prompt` belongs to the held-out (test) side of the fixed prompt partition."""
    return _bucket(prompt) < HELD_OUT_PERCENT


def is_validation(prompt: str) -> bool:
    """Whether `prompt` belongs to the validation part of the fixed prompt partition (never test)."""
    return HELD_OUT_PERCENT <= _bucket(prompt) < HELD_OUT_PERCENT + VALIDATION_PERCENT


def split_of(prompt: str) -> str:
    """"test", "validation" or "train": the side of the fixed partition `prompt` falls on."""
    return "test" if is_held_out(prompt) else "validation" if is_validation(prompt) else "train"


def carve_validation(examples: list[Example], n: int) -> tuple[list[Example], list[Example]]:
    """Split rows of a training file by the same partition: (rows whose prompt is not a validation
    prompt, the first n distinct validation prompts). Deterministic and independent of row order
    for the first list; the second keeps file order."""
    rest: list[Example] = []
    validation: list[Example] = []
    seen: set[str] = set()
    for example in examples:
        if not is_validation(example.prompt):
            rest.append(example)
        elif example.prompt not in seen and len(validation) < n:
            seen.add(example.prompt)
            validation.append(example)
    return rest, validation


@functools.lru_cache(maxsize=1 << 16)  # tasks draw the same small expressions many times
def evaluate_expression(expression: str) -> tuple[Fraction, tuple[int, ...]]:
    """Exact value of an expression of non-negative integers, + - * / and parentheses, and the
    integer literals it uses. Raises ValueError for anything else; ZeroDivisionError on x/0."""
    if not set(expression) <= _EXPRESSION_CHARS:
        raise ValueError(f"expression {expression!r} has characters other than digits, + - * / ( ) and spaces")
    used: list[int] = []

    def visit(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPERATORS:
            return _BINARY_OPERATORS[type(node.op)](visit(node.left), visit(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        raise ValueError(f"expression {expression!r}: {type(node).__name__} is not allowed")

    return visit(ast.parse(expression, mode="eval").body), tuple(used)


def countdown_reward(completion: str, ground_truth: str, **metadata: Any) -> float:
    """1.0 if the completion is an expression over the given numbers (each used at most once,
    only + - * / and parentheses) that equals the target, else 0.0. Text from the first "=" on is
    ignored, so "3*5+7=22" counts. `ground_truth` is JSON {"target": int, "numbers": [int, ...]}."""
    target, numbers = _parse_countdown_truth(ground_truth)
    expression = completion.split("=", 1)[0].strip()
    if not expression or len(expression) > _MAX_EXPRESSION_CHARS:
        return 0.0
    try:
        value, used = evaluate_expression(expression)
    except (ValueError, SyntaxError, ZeroDivisionError, RecursionError, MemoryError):
        return 0.0
    if Counter(used) - Counter(numbers):  # a number that was not given, or used too often
        return 0.0
    return 1.0 if value == target else 0.0


def _parse_countdown_truth(ground_truth: str) -> tuple[int, list[int]]:
    try:
        truth = json.loads(ground_truth)
        target, numbers = truth["target"], truth["numbers"]
    except (json.JSONDecodeError, TypeError, KeyError):
        raise ValueError(
            f'countdown ground truth must be JSON {{"target": int, "numbers": [int, ...]}}, got {ground_truth!r}'
        ) from None
    if type(target) is not int or not isinstance(numbers, list) or not all(type(x) is int for x in numbers):
        raise ValueError(f"countdown ground truth needs an int target and a list of int numbers, got {ground_truth!r}")
    return target, numbers


class Task(ABC):
    """A generator of verifiable examples at one difficulty. Subclasses set the class attributes
    and implement `sample`."""

    name: str  # a class attribute, or set per instance (reasoning_gym:NAME)
    verifier: str | Callable[..., float]  # a reward name or "module:function" spec for asyncflow.rewards, or a reward
    default_difficulty: ClassVar[int]
    train_pool_size: ClassVar[int] = 50_000  # distinct training problems drawn per run (`data.train_size`)
    levels: ClassVar[dict[int, Any]]  # difficulty -> frozen params dataclass

    def __init__(self, difficulty: int | None = None, seed: int = 0) -> None:
        difficulty = self.default_difficulty if difficulty is None else difficulty
        if difficulty not in self.levels:
            raise ValueError(f"task {self.name!r}: difficulty must be one of {sorted(self.levels)}, got {difficulty!r}")
        self.difficulty = difficulty
        self.seed = seed
        self.params = self.levels[difficulty]
        self.label = f"{self.name}-d{difficulty}-s{seed}"
        # cached prefixes of the test and validation streams (kept picklable: no generators)
        self._distinct: dict[str, list[Example]] = {}
        self._exhausted: set[str] = set()
        self._split_metadata: dict[str, dict[str, Any]] = {}

    @abstractmethod
    def sample(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        """One random instance: (prompt, answer, extra metadata)."""

    def examples(self, split: str, n: int | None = None) -> list[Example]:
        """The first n examples of `split` ("train" needs n; "test" and "validation" default to
        TEST_SIZE / VALIDATION_SIZE, or every such prompt when the task has fewer). Asking for more
        test or validation examples than exist raises."""
        if split == "train":
            if n is None or n < 0:
                raise ValueError(f"{self.label}: the train split is an infinite stream; pass n >= 0, got {n!r}")
            cached = _TRAIN_PREFIXES.setdefault(self.label, [])
            if len(cached) < n:  # the stream is deterministic: extend the process-wide prefix, never redraw it
                cached.extend(itertools.islice(self.iter_train(), len(cached), n))
            return cached[:n]
        if split in ("test", "validation"):
            if n is not None and n < 0:
                raise ValueError(f"{self.label}: n must be >= 0, got {n}")
            wanted = (TEST_SIZE if split == "test" else VALIDATION_SIZE) if n is None else n
            cached = self._distinct.setdefault(split, [])
            if len(cached) < wanted and split not in self._exhausted:
                cached[:] = itertools.islice(self._distinct_stream(split), wanted)
                if len(cached) < wanted:
                    self._exhausted.add(split)
            if n is not None and len(cached) < n:
                what = "held-out" if split == "test" else "validation"
                raise ValueError(f"{self.label}: only {len(cached)} distinct {what} prompts exist, asked for {n}")
            return list(cached[:wanted])
        raise ValueError(f"{self.label}: split must be one of {list(SPLITS)}, got {split!r}")

    def iter_train(self) -> Iterator[Example]:
        """The infinite train stream (same items on every call)."""
        rng = random.Random(f"{self.label}/train")
        index = 0
        while True:
            prompt, answer, extra = self.sample(rng)
            if split_of(prompt) == "train":
                yield self._example(prompt, answer, extra, "train", index)
                index += 1

    def _distinct_stream(self, split: str) -> Iterator[Example]:
        """Distinct prompts of `split` ("test" or "validation") from its own seeded stream."""
        rng = random.Random(f"{self.label}/{split}")
        seen: set[str] = set()
        draws_without_new = 0
        while draws_without_new < _EXHAUSTION_DRAWS:
            prompt, answer, extra = self.sample(rng)
            draws_without_new += 1
            if split_of(prompt) == split and prompt not in seen:
                seen.add(prompt)
                draws_without_new = 0
                yield self._example(prompt, answer, extra, split, len(seen) - 1)

    def _example(self, prompt: str, answer: str, extra: dict[str, Any], split: str, index: int) -> Example:
        # the examples of a split without fields of their own share one metadata dict (50,000 copies cost ~9 MB)
        shared = self._split_metadata.setdefault(split, {"task": self.name, "difficulty": self.difficulty,
                                                         "split": split})
        metadata = {**shared, **extra} if extra else shared
        return Example(prompt=prompt, answer=answer, metadata=metadata, source=f"{self.label}/{split}[{index}]")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(difficulty={self.difficulty}, seed={self.seed}, params={self.params})"


@dataclass(frozen=True)
class ArithmeticParams:
    operands: int
    max_digits: int  # operands are drawn uniformly from [0, 10**max_digits)
    operators: str


class ArithmeticTask(Task):
    """Integer arithmetic with Python precedence: "12+35=" -> "47"."""

    name = "arithmetic"
    verifier = "numeric_match"
    default_difficulty = 2
    levels = {
        1: ArithmeticParams(operands=2, max_digits=1, operators="+"),
        2: ArithmeticParams(operands=2, max_digits=2, operators="+"),
        3: ArithmeticParams(operands=2, max_digits=3, operators="+-"),
        4: ArithmeticParams(operands=3, max_digits=2, operators="+-"),
        5: ArithmeticParams(operands=3, max_digits=2, operators="+-*"),
    }

    def sample(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        operands = [str(rng.randrange(10**self.params.max_digits)) for _ in range(self.params.operands)]
        expression = operands[0]
        for operand in operands[1:]:
            expression += rng.choice(self.params.operators) + operand
        value, _ = evaluate_expression(expression)
        return f"{expression}=", str(int(value)), {}


class ToolArithmeticTask(Task):
    """Arithmetic a tiny model cannot do in its head, meant to be solved with a calculator tool (a multi-turn
    environment such as `env.name: calculator`): "37*48+215=" -> "1991". `metadata["expression"]` is the
    expression, which a tool-use demonstration passes to the calculator."""

    name = "tool_arithmetic"
    verifier = "numeric_match"
    default_difficulty = 2
    levels = {
        1: ArithmeticParams(operands=2, max_digits=2, operators="*"),
        2: ArithmeticParams(operands=3, max_digits=2, operators="*+"),
        3: ArithmeticParams(operands=4, max_digits=2, operators="*+-"),
    }

    def sample(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        operands = [str(rng.randrange(10, 10**self.params.max_digits)) for _ in range(self.params.operands)]
        expression = operands[0]
        for i, operand in enumerate(operands[1:]):
            expression += self.params.operators[i % len(self.params.operators)] + operand
        value, _ = evaluate_expression(expression)
        return f"{expression}=", str(int(value)), {"expression": expression}


@dataclass(frozen=True)
class DigitSequenceParams:
    length: int


_SEQUENCE_LEVELS = {1: DigitSequenceParams(3), 2: DigitSequenceParams(4), 3: DigitSequenceParams(5),
                    4: DigitSequenceParams(6), 5: DigitSequenceParams(8)}


class ReverseTask(Task):
    """Reverse a digit string: "rev:3817=" -> "7183"."""

    name = "reverse"
    verifier = "exact_match"
    default_difficulty = 2
    levels = _SEQUENCE_LEVELS

    def sample(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        digits = "".join(rng.choice("0123456789") for _ in range(self.params.length))
        return f"rev:{digits}=", digits[::-1], {}


class SortTask(Task):
    """Sort the digits of a digit string ascending: "sort:3817=" -> "1378"."""

    name = "sort"
    verifier = "exact_match"
    default_difficulty = 2
    levels = _SEQUENCE_LEVELS

    def sample(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        digits = "".join(rng.choice("0123456789") for _ in range(self.params.length))
        return f"sort:{digits}=", "".join(sorted(digits)), {}


@dataclass(frozen=True)
class CountdownParams:
    count: int  # how many numbers are given
    max_number: int  # numbers are drawn from [1, max_number]
    max_target: int  # targets lie in [1, max_target]


class CountdownTask(Task):
    """Reach a target with + - * / over given numbers, each used at most once: "3,5,7->22:"."""

    name = "countdown"
    verifier = "asyncflow.data.tasks:countdown_reward"
    default_difficulty = 2
    levels = {
        1: CountdownParams(count=2, max_number=9, max_target=99),
        2: CountdownParams(count=3, max_number=12, max_target=99),
        3: CountdownParams(count=4, max_number=9, max_target=199),
        4: CountdownParams(count=4, max_number=25, max_target=499),
        5: CountdownParams(count=5, max_number=25, max_target=999),
    }

    def sample(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        while True:
            numbers = sorted(rng.randint(1, self.params.max_number) for _ in range(self.params.count))
            target, solution = self._random_solution(rng, numbers)
            if 1 <= target <= self.params.max_target:
                break
        prompt = f"{','.join(map(str, numbers))}->{target}:"
        answer = json.dumps({"target": target, "numbers": numbers}, separators=(",", ":"))
        return prompt, answer, {"solution": solution}

    @staticmethod
    def _random_solution(rng: random.Random, numbers: list[int]) -> tuple[int, str]:
        """Combine random pairs until one value is left, keeping every intermediate a positive
        integer (as in the countdown game): (value, fully parenthesised expression)."""
        pool = [(number, str(number)) for number in numbers]
        while len(pool) > 1:
            i, j = rng.sample(range(len(pool)), 2)
            (a, left), (b, right) = pool[i], pool[j]
            operator = rng.choice("+-*/")
            if operator == "-" and a <= b:
                operator = "+"
            if operator == "/" and a % b:
                operator = "*"
            value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[operator]
            pool = [item for k, item in enumerate(pool) if k not in (i, j)] + [(value, f"({left}{operator}{right})")]
        value, expression = pool[0]
        return value, expression[1:-1] if len(numbers) > 1 else expression


TASKS: dict[str, type[Task]] = {
    task.name: task for task in (ArithmeticTask, ReverseTask, SortTask, CountdownTask, ToolArithmeticTask)
}


def make_task(name: str, difficulty: int | None = None, seed: int = 0, options: dict[str, Any] | None = None,
              partial_credit: bool = True) -> Task:
    """A built-in task by name (difficulty None means the task's default), or `reasoning_gym:NAME`, a dataset of
    reasoning-gym with `options` as its config and `partial_credit` (`asyncflow.data.reasoning_gym`)."""
    if name.startswith("reasoning_gym:"):
        from asyncflow.data.reasoning_gym import ReasoningGymTask

        return ReasoningGymTask(name.removeprefix("reasoning_gym:"), options, seed=seed, partial_credit=partial_credit)
    if options:
        raise ValueError(f"data.task_options are the config of a reasoning_gym:NAME task, not {name!r}'s")
    if not partial_credit:
        raise ValueError(f"data.partial_credit=false is for reasoning_gym:NAME tasks; {name!r} scores 0 or 1 already")
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {sorted(TASKS)}, or reasoning_gym:NAME")
    return TASKS[name](difficulty=difficulty, seed=seed)
