"""A verifiers environment for `env.name: verifiers:examples/verifiers/arithmetic_env.py` (see
docs/bring-your-own.md): two-digit sums, written with the library's own API. The model answers; a wrong answer is
told "Wrong, try again." and gets another turn, up to `max_turns`; the rubric scores the last answer (1 if it is the
sum) and, with weight `turn_penalty`, the number of turns taken.

    asyncflow train examples/verifiers_grpo.yaml

The texts are printable ASCII on one line, so the character tokenizer of the tiny presets can express them.
"""

import random

import verifiers as vf
from datasets import Dataset


def correct_answer(completion, answer, parser, **kwargs) -> float:
    """1.0 when the model's last reply is the sum (spaces stripped)."""
    return float((parser.parse_answer(completion) or "").strip() == answer)


def turns_taken(completion, parser, **kwargs) -> float:
    return float(len(parser.get_assistant_messages(completion)))


class RetryEnv(vf.MultiTurnEnv):
    """Ends when the last reply is right; otherwise asks again (until `max_turns`)."""

    @vf.stop
    async def solved(self, state) -> bool:
        trajectory = state["trajectory"]
        return bool(trajectory) and correct_answer(trajectory[-1]["completion"], state["answer"], self.parser) == 1.0

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content="Wrong, try again.")]


def load_environment(num_examples: int = 2000, max_turns: int = 2, turn_penalty: float = 0.1, seed: int = 0):
    rng = random.Random(seed)
    pairs = [(rng.randrange(10, 100), rng.randrange(10, 100)) for _ in range(num_examples)]
    dataset = Dataset.from_list([{"question": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs])
    parser = vf.Parser()
    rubric = vf.Rubric(funcs=[correct_answer, turns_taken], weights=[1.0, -turn_penalty], parser=parser)
    return RetryEnv(dataset=dataset, system_prompt="Answer with the sum only.", parser=parser, rubric=rubric,
                    max_turns=max_turns)
