"""Built-in tiny models and an offline character-level tokenizer; the entry point of every preset.

Owns: the character presets (tiny Llama and Qwen2 configurations, random init), the character
tokenizer used by the built-in tasks, and `build_preset`, which also builds the real-shaped presets
with a byte-level BPE tokenizer (`asyncflow.models.bpe`, e.g. `qwen2.5-0.5b`, `qwen2.5-tiny-2l`).
All are written as ordinary Hugging Face folders (`config.json` + safetensors weights, `tokenizer.json` +
`tokenizer_config.json`) so that they load back through `asyncflow.models.loading`, the same code path a
user's own model takes.

Invariant: a preset is fully determined by (name, vocabulary, seed); building it twice gives
byte-identical weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3MoeConfig,
)

from asyncflow.models.bpe import bpe_preset_names, build_bpe_preset, is_bpe_preset

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD, BOS, EOS)

# Printable ASCII covers the built-in tasks, user prompts in plain text, and answer tags.
DEFAULT_ALPHABET = "".join(chr(c) for c in range(32, 127))

#: name -> (architecture, hidden, layers, heads, kv heads, intermediate, max positions)
PRESETS: dict[str, tuple[str, int, int, int, int, int, int]] = {
    "tiny-llama": ("llama", 128, 4, 4, 2, 384, 512),  # ~0.8M parameters
    "tiny-qwen2": ("qwen2", 128, 4, 4, 2, 384, 512),
    "small-llama": ("llama", 256, 6, 8, 4, 768, 1024),  # ~5M parameters
    "small-qwen2": ("qwen2", 256, 6, 8, 4, 768, 1024),
    "base-llama": ("llama", 384, 8, 6, 2, 1152, 2048),  # ~14M parameters
    "tiny-llama-tools": ("llama", 128, 4, 4, 2, 384, 512),  # tiny-llama with TOOL_TOKENS in its vocabulary
    "tiny-moe": ("qwen3_moe", 128, 4, 4, 2, 384, 512),  # Qwen3-MoE's shape: MOE_SHAPES; ~1.5M parameters
}

#: Mixture-of-experts presets: experts per layer, experts per token, each expert's intermediate size (every layer
#: sparse, top-k weights renormalised, as Qwen3-MoE does).
MOE_SHAPES: dict[str, tuple[int, int, int]] = {"tiny-moe": (8, 2, 96)}

#: The fixed pieces of the Hermes/Qwen tool-call format (`<tool_call>{"name":"calculator","arguments":
#: {"expression":"37*48"}}</tool_call>`) as single tokens, as a subword vocabulary holds them: a character
#: model with them spends 9 tokens on a call's fixed text instead of 70, which makes multi-turn RL on CPU cheap.
TOOL_TOKENS = (
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    '{"name":"', '","arguments":{', '"expression":"', '"code":"', '"}}', "calculator", "python",
)
PRESET_EXTRA_TOKENS: dict[str, tuple[str, ...]] = {"tiny-llama-tools": TOOL_TOKENS}


def build_char_tokenizer(
    alphabet: str = DEFAULT_ALPHABET, extra_tokens: tuple[str, ...] = ()
) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character, plus pad/bos/eos (and `extra_tokens`, each one
    token, matched before the characters; decoded as text).

    Characters outside `alphabet` are an error at encode time (no unknown token), so a
    task whose text the vocabulary cannot express fails loudly instead of training on garbage.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in dict.fromkeys(alphabet):
        vocab.setdefault(ch, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        clean_up_tokenization_spaces=False,
        model_max_length=100_000,
    )
    if extra_tokens:
        fast.add_tokens(list(extra_tokens))
    return fast


def preset_names() -> list[str]:
    """Every preset name: the character presets, then the BPE architectures (each also as `NAME-<N>l`)."""
    return sorted(PRESETS) + [f"{name}[-<N>l]" for name in bpe_preset_names()]


def preset_config(name: str, vocab_size: int, pad_id: int, bos_id: int, eos_id: int) -> PretrainedConfig:
    """The transformers config of preset `name` for a given vocabulary."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {preset_names()}")
    arch, hidden, layers, heads, kv_heads, inter, max_pos = PRESETS[name]
    config_class: Callable[..., PretrainedConfig] = {
        "llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig}[arch]
    moe = {}
    if name in MOE_SHAPES:
        experts, per_token, expert_size = MOE_SHAPES[name]
        moe = dict(num_local_experts=experts, num_experts_per_tok=per_token, moe_intermediate_size=expert_size,
                   norm_topk_prob=True, head_dim=hidden // heads)
    return config_class(
        **moe,
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=inter,
        max_position_embeddings=max_pos,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        tie_word_embeddings=True,
        rope_theta=10_000.0,
    )


def build_preset(name: str, out_dir: str | Path, *, seed: int = 0) -> Path:
    """Create preset `name` with random weights and save model + tokenizer to `out_dir`.

    Returns `out_dir`. Existing folders with a matching `asyncflow_preset.json` stamp are reused.
    A BPE preset's name (`asyncflow.models.bpe`) is built by `build_bpe_preset`.
    """
    if is_bpe_preset(name):
        return build_bpe_preset(name, out_dir, seed=seed)
    out = Path(out_dir)
    stamp = {"preset": name, "seed": seed, "alphabet": DEFAULT_ALPHABET}
    stamp_file = out / "asyncflow_preset.json"
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        return out
    tokenizer = build_char_tokenizer(extra_tokens=PRESET_EXTRA_TOKENS.get(name, ()))
    config = preset_config(name, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    stamp_file.write_text(json.dumps(stamp))
    return out
