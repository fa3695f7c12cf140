"""Multi-turn rollouts keep token ids end to end, with a real HF tokenizer that has a chat template.

The episodes run on a real tiny model through `EngineService` and a local TransferQueue; a recording
engine keeps every completion the model sampled, and the test rebuilds each row independently from them
(sampled ids, then the chat template's ids around the observation) and compares byte for byte.
"""

from __future__ import annotations

import pytest
import torch

from asyncflow.engines.base import SamplingParams
from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.envs import StepResult
from asyncflow.models.loading import load_model, load_tokenizer, render_prompt
from asyncflow.models.logprobs import TrainSample, response_logprobs
from asyncflow.models.packing import packed_response_logprobs
from asyncflow.models.presets import build_preset
from asyncflow.transfer import TransferQueue
from asyncflow.workers.multiturn import EpisodeRunner, MultiTurnRolloutWorker, TurnTemplate
from asyncflow.workers.rollout import rollouts_from_batch

# ChatML with spaces for newlines (the character vocabulary is printable ASCII)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
TURNS = 3


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, one_torch_thread):
    """A tiny Llama whose tokenizer has ChatML special tokens (EOS = <|im_end|>) and a chat template, saved and
    loaded back as an ordinary HF folder."""
    folder = build_preset("tiny-llama", tmp_path_factory.mktemp("chat") / "model")
    tokenizer = load_tokenizer(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = CHATML
    model = load_model(folder)
    model.resize_token_embeddings(len(tokenizer))
    model.config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return load_model(folder), load_tokenizer(folder)


class CountingEnv:
    """Answers every turn with an observation until `TURNS` model turns, then scores 1."""

    def reset(self, row):
        self.turn = 0
        self.row = row

    def step(self, model_text):
        self.turn += 1
        if self.turn == TURNS:
            return StepResult(reward=1.0, done=True, info={"tool_calls": TURNS - 1})
        return StepResult(observation=f"obs {self.row['sample_index']}/{self.turn}", info={"tool_calls": self.turn})


class RecordingEngine:
    """The real engine, keeping each completion by the prompt it was sampled for."""

    def __init__(self, engine):
        self.engine = engine
        self.sampled: dict[tuple[int, ...], object] = {}

    @property
    def weight_version(self):
        return self.engine.weight_version

    def update_weights(self, state_dict, version):
        self.engine.update_weights(state_dict, version)

    def generate(self, requests, params):
        for completion in self.engine.generate(requests, params):
            self.sampled[tuple(completion.prompt_ids)] = completion
            yield completion


def test_template_pieces_come_from_the_chat_template(chat_model):
    _, tokenizer = chat_model
    template = TurnTemplate.from_tokenizer(tokenizer)
    text = tokenizer.decode(template.observation_ids(tokenizer, "42"))
    assert text == " <|im_start|>tool 42<|im_end|> <|im_start|>assistant "


def test_trained_ids_are_the_sampled_ids_plus_the_tool_ids(chat_model):
    model, tokenizer = chat_model
    engine = RecordingEngine(TorchInferenceEngine(model, max_batch_size=4, seed=1))
    # many stop tokens: the random model ends most turns within a few tokens, so episodes reach their last turn
    stops = (tokenizer.eos_token_id, *range(3, 60))
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=stops)
    template = TurnTemplate.from_tokenizer(tokenizer)
    runner = EpisodeRunner(tokenizer, template, CountingEnv, params, max_turns=TURNS, max_context_tokens=400)
    worker = MultiTurnRolloutWorker(engine, params, group_size=2, runner=runner, concurrency=3)

    # the chat template, as the data plane renders prompts; distinct per row, so each completion is found by prompt
    prompts = [render_prompt(tokenizer, f"12*34+{k}=") for k in range(6)]
    queue = TransferQueue.local(tasks=["rollout", "train"], timeout=30)
    queue.create_partition("step_0", num_rows=6, group_size=2)
    queue.append("step_0", {"prompt_ids": [torch.tensor(p) for p in prompts]}, group_ids=[0, 0, 1, 1, 2, 2],
                 metadata=[{"answer": "408", "sample_index": k} for k in range(6)])
    assert worker.run_partition(queue, "step_0", batch_size=6, timeout=30) == 6
    meta = queue.request("step_0", "train", ["prompt_ids", "response_ids", "rollout_logprobs", "reward", "loss_mask"],
                         6, timeout=10)
    rollouts = rollouts_from_batch(queue.get(meta))

    for rollout in rollouts:
        prompt = rollout.prompt_ids
        assert prompt == prompts[rollout.metadata["sample_index"]]
        expected_ids, expected_mask, expected_logprobs = [], [], []
        for turn in range(1, TURNS + 1):
            completion = engine.sampled[tuple(prompt + expected_ids)]
            expected_ids += completion.response_ids
            expected_mask += [1] * len(completion.response_ids)
            expected_logprobs += completion.logprobs
            if completion.finish_reason == "length":
                break
            if turn < TURNS:
                text = f"obs {rollout.metadata['sample_index']}/{turn}"
                tool_ids = tokenizer.encode(f" <|im_start|>tool {text}<|im_end|> <|im_start|>assistant ",
                                            add_special_tokens=False)
                expected_ids += tool_ids
                expected_mask += [0] * len(tool_ids)
                expected_logprobs += [0.0] * len(tool_ids)
        assert rollout.response_ids == expected_ids
        assert rollout.loss_mask == expected_mask
        assert torch.equal(torch.tensor(rollout.rollout_logprobs), torch.tensor(expected_logprobs))
        assert rollout.weight_version == 0
        ended = rollout.finish_reason
        assert rollout.reward == (1.0 if ended == "stop" else 0.0)
    finished = [r for r in rollouts if r.finish_reason == "stop"]
    assert finished, "no episode reached its last turn (every one was cut by max_new_tokens)"
    assert all(r.metadata["turns"] == TURNS and r.metadata["env/tool_calls"] == TURNS - 1 for r in finished)


def test_a_transcript_past_the_context_length_ends_with_length(chat_model):
    model, tokenizer = chat_model
    engine = TorchInferenceEngine(model, max_batch_size=2, seed=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=50, stop_token_ids=(tokenizer.eos_token_id,))
    prompt = render_prompt(tokenizer, "1+1=")
    limit = len(prompt) + 12
    runner = EpisodeRunner(tokenizer, TurnTemplate.from_tokenizer(tokenizer), CountingEnv, params, max_turns=10,
                           max_context_tokens=limit)
    worker = MultiTurnRolloutWorker(engine, params, group_size=1, runner=runner, concurrency=2)
    from asyncflow.data.prompts import Prompt  # noqa: PLC0415

    rollouts = list(worker.generate([Prompt(g, prompt, "2") for g in range(4)]))
    assert all(r.finish_reason == "length" and r.reward == 0.0 for r in rollouts)
    assert all(len(r.prompt_ids) + len(r.response_ids) <= limit for r in rollouts)


def test_masked_tokens_carry_no_loss_kl_or_entropy_packed_or_not(chat_model):
    """The trained mask is the loss mask (tool tokens are context only), in both log-prob paths, which agree."""
    model, _ = chat_model
    prompt = [5, 6, 7, 8]
    samples = [
        TrainSample(prompt, [10, 11, 12, 13, 14, 15], group_id=0, loss_mask=[1, 1, 0, 0, 0, 1]),
        TrainSample(prompt, [20, 21, 22], group_id=0, loss_mask=[1, 0, 1]),
        TrainSample(prompt, [30, 31], group_id=0),
    ]
    plain = response_logprobs(model, samples, with_entropy=True)
    packed = packed_response_logprobs(model, samples, with_entropy=True)
    expected = torch.tensor([[1, 1, 0, 0, 0, 1], [1, 0, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    for out in (plain, packed):
        assert torch.equal(out.mask, expected)
        assert (out.logprobs[~expected] == 0).all() and (out.entropy[~expected] == 0).all()
    torch.testing.assert_close(plain.logprobs, packed.logprobs, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="loss_mask"):
        response_logprobs(model, [TrainSample(prompt, [1, 2], loss_mask=[1])])
