"""An agent written against the `openai` client, trained by `asyncflow train examples/agent_grpo.yaml`.

`asyncflow train` calls `solve(client, row)` once per sample with a client bound to the run's own server
(`row.model` is the model name to ask for, `row.prompt` the task's prompt, e.g. "37+58="). The same function
runs unchanged against `asyncflow serve` or any OpenAI-compatible endpoint.
"""

import re


def solve(client, row) -> str:
    """Ask for the sum; when the reply holds no number, ask once more, continuing the same text. Returns the final
    reply, which the run scores with its reward functions (`numeric_match` for the arithmetic task)."""
    prompt = row.prompt
    reply = client.completions.create(model=row.model, prompt=prompt, max_tokens=8).choices[0].text
    if not re.search(r"\d", reply):
        prompt = f"{prompt}{reply} {row.prompt}"
        reply = client.completions.create(model=row.model, prompt=prompt, max_tokens=8).choices[0].text
    return reply
