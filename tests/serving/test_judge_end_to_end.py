"""A judge reward end to end through two live `asyncflow serve` servers on loopback: the policy server answers
prompts, the judge server scores each answer. The judge is a tiny locally built model whose weights make it
answer `1` whatever it reads (every layer's output zeroed, the embedding of `1` the largest), so the test checks
the path (template rendering, HTTP, the served chat template, the API key, parsing, counting), not a judge's
wisdom; the judge server's episode recorder shows what the judge was asked."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402
from server_fixture import KEY, NAME, TEMPLATE, running_server  # noqa: E402

from asyncflow.models.loading import load_model, load_tokenizer  # noqa: E402
from asyncflow.rewards import RewardRunner  # noqa: E402
from asyncflow.rewards.judge import JudgeReward  # noqa: E402


def always_one_judge(base_path, out_dir):
    """A copy of the tiny model that greedily answers `1`: with every attention and MLP output zeroed the last
    hidden state is the normalised embedding of the last prompt token; all embeddings (tied to the output
    layer) are one vector, `1`'s twice as long, so `1` has the highest logit after any token."""
    model, tokenizer = load_model(base_path), load_tokenizer(base_path)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embedding = model.get_input_embeddings().weight
        embedding.fill_(0.1)
        embedding[tokenizer.convert_tokens_to_ids("1")] *= 2
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def test_a_judge_served_by_asyncflow_serve_scores_the_policy_servers_answers(
        tiny_llama_path, tmp_path, monkeypatch, one_torch_thread):
    judge_path = always_one_judge(tiny_llama_path, tmp_path / "judge")
    monkeypatch.setenv("JUDGE_KEY", KEY)
    prompts, answers = ["12+34=", "5*6=", "9-4="], ["46", "30", "5"]
    with running_server(tiny_llama_path, TEMPLATE) as (policy, _, _), \
            running_server(judge_path, TEMPLATE) as (judge_server, _, recorder):
        headers = {"Authorization": f"Bearer {KEY}"}
        responses = []
        for prompt in prompts:
            body = {"model": NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": 6,
                    "temperature": 0}
            reply = httpx.post(policy.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
            responses.append(reply.raise_for_status().json()["choices"][0]["message"]["content"])
        recorder.open("judged")
        judge = JudgeReward(judge_server.url + "/episodes/judged/v1", NAME, api_key_env="JUDGE_KEY", max_tokens=1,
                            template="Q: {prompt} A: {response} Gold: {answer} Correct (1/0)?", timeout_s=30)
        result = RewardRunner(judge, timeout_s=60).score(responses, answers, [{"prompt": p} for p in prompts])
        calls = recorder.close("judged")
    assert result.rewards == [1.0, 1.0, 1.0] and result.n_errors == result.n_timeouts == 0
    tokenizer = load_tokenizer(judge_path)
    asked = sorted(tokenizer.decode(call.prompt_ids) for call in calls)
    expected = sorted(f"<s>user: Q: {p} A: {r} Gold: {a} Correct (1/0)?</s><s>assistant: "
                      for p, r, a in zip(prompts, responses, answers))
    assert asked == expected, "the judge read each prompt, the policy server's answer and the ground truth"
    assert all(tokenizer.decode(call.response_ids) == "1" for call in calls)
