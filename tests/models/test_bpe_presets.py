"""The real-shaped presets with a byte-level BPE tokenizer (`asyncflow.models.bpe`): published shapes and parameter
counts, a folder that loads through AutoTokenizer / AutoModelForCausalLM alone and builds deterministically, special
tokens never split, text round-trips, EOS (and the generation config's EOS ids) stop the built-in engine, padding,
the training path's prompt equals what `serve` renders, and trained ids are the sampled ones in multi-turn and
`serve` episodes (`retokenize_drift_tokens` is 0)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncflow.config import load_config
from asyncflow.data.corpus import CORPUS_FILE, tokenizer_corpus
from asyncflow.data.prompts import Prompt
from asyncflow.data.tasks import TASKS, make_task
from asyncflow.engines.base import GenerationRequest, SamplingParams, Transcript
from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.envs import StepResult
from asyncflow.models.bpe import (
    ARCHITECTURES,
    SPECIAL_TOKENS,
    TOOL_CALL_TOKENS,
    bpe_preset_config,
    build_bpe_tokenizer,
    parse_bpe_preset,
)
from asyncflow.models.loading import eos_token_ids, load_generation_config, load_model, load_tokenizer, render_prompt
from asyncflow.models.presets import build_preset
from asyncflow.workers.multiturn import EpisodeRunner, MultiTurnRolloutWorker, TurnTemplate
from asyncflow.workflow.kinds import environment_kind
from asyncflow.workflow.pipeline import rollout_metrics
from asyncflow.workflow.setup import sampling_params

PRESET = "qwen2.5-tiny-2l"
TASK_TEXT = [ex.prompt + ex.answer for name in sorted(TASKS) for ex in make_task(name).examples("test", 64)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_preset(PRESET, tmp_path_factory.mktemp("bpe") / PRESET)


@pytest.fixture(scope="module")
def tokenizer(folder):
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def model(folder, one_torch_thread):
    return load_model(folder).eval().requires_grad_(False)


def test_the_corpus_file_is_the_tasks_text():
    assert CORPUS_FILE.read_text() == "\n".join(tokenizer_corpus()) + "\n", (
        "run `python -m asyncflow.data.corpus` to regenerate src/asyncflow/models/bpe_corpus.txt")


@pytest.mark.parametrize("name, family, params, shape", [
    ("qwen2.5-0.5b", "qwen2", 494_032_768, (896, 24, 14, 2, 4864, 151936)),
    ("llama-3.2-1b", "llama", 1_235_814_400, (2048, 16, 32, 8, 8192, 128256)),
])
def test_published_shapes_and_parameter_counts(name, family, params, shape):
    tokenizer = build_bpe_tokenizer()
    config = bpe_preset_config(name, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    assert config.model_type == family and config.tie_word_embeddings
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size) == shape
    assert config.vocab_size > len(tokenizer)  # padded past the tokenizer, as the published models are
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == params
    if family == "llama":
        assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["rope_theta"] == 500_000.0
    else:
        assert config.rope_parameters["rope_theta"] == 1_000_000.0 and config.max_position_embeddings == 32768


def test_a_layer_suffix_keeps_the_shape_and_bad_names_list_the_choices():
    assert parse_bpe_preset("qwen2.5-0.5b-2l").layers == 2
    assert parse_bpe_preset("qwen2.5-0.5b-2l").hidden == ARCHITECTURES["qwen2.5-0.5b"].hidden
    with pytest.raises(ValueError, match="has 24 layers"):
        parse_bpe_preset("qwen2.5-0.5b-25l")
    with pytest.raises(ValueError, match="qwen2.5-0.5b"):
        build_preset("qwen3-0.6b", "/nonexistent")


def test_the_folder_loads_as_any_downloaded_one_and_builds_byte_identically(folder, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None and tokenizer.padding_side == "right"
    saved = json.loads((folder / "tokenizer_config.json").read_text())
    assert "{%- if tools %}" in saved["chat_template"] and "<tool_call>" in saved["chat_template"]
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size >= len(tokenizer)
    assert load_generation_config(folder).eos_token_id == [tokenizer.eos_token_id, tokenizer.pad_token_id]

    again = build_preset(PRESET, tmp_path / "again")
    files = sorted(p.name for p in folder.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    for name in files:
        assert (folder / name).read_bytes() == (again / name).read_bytes(), name


def test_special_and_tool_tokens_are_never_split(tokenizer):
    for token in (*SPECIAL_TOKENS, *TOOL_CALL_TOKENS):
        [token_id] = tokenizer.encode(token, add_special_tokens=False)
        for text in (f"a{token}b", f"12+3{token}\n", f"{token}{token}", f" {token} x"):
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert ids.count(token_id) == text.count(token), text
            assert tokenizer.decode(ids) == text
    # the trained merges never swallow a piece of a special token
    ids = tokenizer.encode("<|im_start|>assistant\n<tool_call>", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids)[0] == "<|im_start|>" and ids[-1] == tokenizer.encode(
        "<tool_call>", add_special_tokens=False)[0]


def test_task_text_and_any_unicode_round_trip(tokenizer):
    texts = TASK_TEXT + ["héllo wörld ’ 😀 \t tabs\r\n", '{"name": "calculator", "arguments": {"expression": "1+1"}}']
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    digits = tokenizer.encode("12345", add_special_tokens=False)
    assert len(digits) == 5  # Qwen2's pre-tokenizer: one token per digit


def _forced_first_token(model, prompt_ids: list[int], token: int) -> None:
    """Make `token` the greedy first token after `prompt_ids`: its (tied) embedding row becomes twice the row of the
    current greedy token, whose logit is positive, so its own logit is twice as large."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0, -1]
        top = int(logits.argmax())
        assert logits[top] > 0
        embedding = model.get_input_embeddings().weight
        embedding[token] = 2 * embedding[top]
        assert int(model(torch.tensor([prompt_ids])).logits[0, -1].argmax()) == token


@pytest.mark.parametrize("stop_token", ["<|im_end|>", "<|endoftext|>"])
@pytest.mark.slow
def test_eos_and_the_generation_configs_eos_stop_the_engine(folder, tokenizer, stop_token):
    model = load_model(folder).eval().requires_grad_(False)
    prompt = tokenizer.encode("12+35=", add_special_tokens=False)  # no special token: its embedding changes below
    stop_id = tokenizer.convert_tokens_to_ids(stop_token)
    _forced_first_token(model, prompt, stop_id)
    config = load_config(None, [f"model.path={folder}", "rollout.max_new_tokens=8"])
    params = sampling_params(config, tokenizer, greedy=True)
    assert set(params.stop_token_ids) == {tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert eos_token_ids(tokenizer, load_generation_config(folder)) == params.stop_token_ids
    engine = TorchInferenceEngine(model, max_batch_size=2)
    [done] = engine.generate([GenerationRequest(0, prompt)], params)
    assert done.response_ids == [stop_id] and done.finish_reason == "stop"
    [unstopped] = engine.generate([GenerationRequest(0, prompt)], SamplingParams(0.0, max_new_tokens=3))
    assert unstopped.response_ids[0] == stop_id and len(unstopped.response_ids) == 3


def test_padding_side_and_batched_prompts_of_different_lengths(tokenizer, model):
    batch = tokenizer(["1+2=", "rev:38175="], padding=True)
    assert batch["input_ids"][0][-1] == tokenizer.pad_token_id and batch["attention_mask"][0][-1] == 0
    # the engine pads its batches itself (right, causal): a prompt's greedy tokens do not depend on its neighbours
    prompts = [render_prompt(tokenizer, text) for text in ("1+2=", "rev:38175=", "98*76+54=")]
    assert len({len(p) for p in prompts}) == 3
    params = SamplingParams(0.0, max_new_tokens=5)
    engine = TorchInferenceEngine(model, max_batch_size=4)
    together = {c.request_id: c.response_ids
                for c in engine.generate([GenerationRequest(i, p) for i, p in enumerate(prompts)], params)}
    for i, prompt in enumerate(prompts):
        [alone] = engine.generate([GenerationRequest(i, prompt)], params)
        assert alone.response_ids == together[i]


@pytest.mark.slow
def test_the_training_prompt_is_what_serve_renders(folder, tokenizer):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    sys.path.insert(0, str(Path(__file__).parents[1] / "serving"))
    from server_fixture import KEY, NAME, running_server

    from asyncflow.serving.episodes import episode_row

    config = load_config(None, [f"model.path={folder}"])
    render = environment_kind(config).render(tokenizer)
    with running_server(folder, None) as (thread, _service, recorder):
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        for text in ("12+35=", "sort:3817=", "3,5,7->22:"):
            reply = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": text}],
                                                   max_tokens=1).choices[0]
            assert reply.prompt_token_ids == render(text) == render_prompt(tokenizer, text)
        # a tool episode through serve: the trained ids are the sampled ones
        recorder.open("tool-episode")
        agent = openai.OpenAI(base_url=thread.url + "/episodes/tool-episode/v1", api_key=KEY, max_retries=0)
        tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
        messages = [{"role": "user", "content": "37*48+215="}]
        for observation in ("1991", "error: unknown tool"):
            reply = agent.chat.completions.create(model=NAME, messages=messages, tools=tools, max_tokens=6).choices[0]
            messages += [{"role": "assistant", "content": reply.message.content},
                         {"role": "tool", "content": observation}]
        agent.chat.completions.create(model=NAME, messages=messages, tools=tools, max_tokens=6)
        row = episode_row(recorder.close("tool-episode"))
    assert row.calls == 3 and row.dropped_calls == 0
    assert row.retokenize_drift_tokens == 0


class ToolObservationEnv:
    """Answers the first two model turns with a tool's output, then scores 1."""

    def reset(self, row):
        self.turn = 0

    def step(self, model_text):
        self.turn += 1
        if self.turn == 3:
            return StepResult(reward=1.0, done=True)
        return StepResult(observation=f"result: {37 * 48 + self.turn}\nrev sort calculator", info={"tool_calls": 1})


def test_multi_turn_episodes_train_the_sampled_ids(tokenizer, model):
    # many stop tokens: the random model ends most turns within a few tokens, so episodes reach their later turns
    stops = (tokenizer.eos_token_id, *range(120, len(tokenizer)))
    params = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=stops)
    template = TurnTemplate.from_tokenizer(tokenizer)
    assert tokenizer.decode(template.observation_ids(tokenizer, "7")) == (
        "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    runner = EpisodeRunner(tokenizer, template, ToolObservationEnv, params, max_turns=3, max_context_tokens=400)
    worker = MultiTurnRolloutWorker(TorchInferenceEngine(model, max_batch_size=4, seed=3), params, group_size=2,
                                    runner=runner, concurrency=2)
    prompts = [Prompt(group_id=g, prompt_ids=render_prompt(tokenizer, f"12*34+{g}="), answer="408", metadata={})
               for g in range(2)]
    rollouts = list(worker.generate(prompts))
    assert len(rollouts) == 4 and max(r.metadata["turns"] for r in rollouts) >= 2
    assert all(r.metadata["retokenize_drift_tokens"] == 0 for r in rollouts)
    assert rollout_metrics(rollouts)["rollout/retokenize_drift_tokens"] == 0


def test_the_drift_count_sees_text_turned_back_into_ids(tokenizer):
    """Sampled one letter at a time, "rev" re-tokenizes as one merged token: the count would show it."""
    sampled = [tokenizer.convert_tokens_to_ids(list("rev")) + [tokenizer.eos_token_id]]
    kept = Transcript([0])
    kept.add_sampled(sampled[0], [0.0] * 4, 0)
    assert kept.count_retokenize_drift(sampled) == 0
    retokenized = Transcript([0])
    ids = tokenizer.encode(tokenizer.decode(sampled[0]), add_special_tokens=False)
    retokenized.add_sampled(ids, [0.0] * len(ids), 0)
    assert len(ids) < len(sampled[0]) and retokenized.count_retokenize_drift(sampled) > 0
