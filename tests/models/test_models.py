import pytest
import torch

from asyncflow.models.loading import ModelLoadError, load_model, load_tokenizer, render_prompt, resolve_model_path
from asyncflow.models.logprobs import TrainSample, response_logprobs
from asyncflow.models.presets import build_preset


@pytest.mark.parametrize(
    "fixture, arch", [("tiny_llama_path", "LlamaForCausalLM"), ("tiny_qwen2_path", "Qwen2ForCausalLM")]
)
def test_presets_load_through_the_hf_path(fixture, arch, request):
    path = request.getfixturevalue(fixture)
    model = load_model(path)
    tokenizer = load_tokenizer(path)
    assert type(model).__name__ == arch
    assert 0.5e6 <= sum(p.numel() for p in model.parameters()) <= 20e6
    ids = render_prompt(tokenizer, "12+35=")
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 7
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12+35="


def test_preset_is_deterministic(tmp_path):
    a = load_model(build_preset("tiny-qwen2", tmp_path / "a", seed=3)).state_dict()
    b = load_model(build_preset("tiny-qwen2", tmp_path / "b", seed=3)).state_dict()
    c = load_model(build_preset("tiny-qwen2", tmp_path / "c", seed=4)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_path(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="unknown model preset"):
        resolve_model_path("preset:huge")


@pytest.mark.slow
def test_batched_logprobs_equal_one_by_one(tiny_llama_path):
    model = load_model(tiny_llama_path)
    samples = [TrainSample([1, 5, 6, 7], [8, 9, 2]), TrainSample([1, 5], [3]), TrainSample([1, 9, 9], [4, 4])]
    batched = response_logprobs(model, samples, with_entropy=True)
    assert batched.mask.sum().item() == 6
    for i, sample in enumerate(samples):
        alone = response_logprobs(model, [sample])
        n = len(sample.response_ids)
        torch.testing.assert_close(batched.logprobs[i, :n], alone.logprobs[0], rtol=1e-5, atol=1e-6)
    # by hand for the first token of sample 1: log softmax of the logits at the last prompt position
    logits = model(torch.tensor([[1, 5]])).logits[0, -1]
    assert torch.allclose(batched.logprobs[1, 0], torch.log_softmax(logits, -1)[3], atol=1e-6)
