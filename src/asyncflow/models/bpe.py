"""Real-shaped model presets with a byte-level BPE tokenizer and a ChatML chat template.

Owns: `ARCHITECTURES` (published shapes such as Qwen2.5-0.5B and Llama-3.2-1B, and small shapes of the same
families for tests), the preset-name grammar `NAME[-<N>l]` (`parse_bpe_preset`), `bpe_preset_config`,
`build_bpe_tokenizer` (byte-level BPE trained by the `tokenizers` library on the built-in tasks' text,
`bpe_corpus.txt`, written by `python -m asyncflow.data.corpus`) and `build_bpe_preset`, which writes an
ordinary Hugging Face folder that loads back through `AutoTokenizer` / `AutoModelForCausalLM` only.

The tokenizer is shaped like Qwen2.5's: NFC, Qwen2's pre-tokenizer regex (digits split one by one), byte-level
BPE, the special tokens `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos) after the trained vocabulary,
the Hermes tool tokens `<tool_call>` / `</tool_call>` as added non-special tokens, no BOS, right padding, and
Qwen2.5's ChatML template (system prompt, the `tools` branch, `<tool_call>` JSON, `tool` messages as
`<tool_response>`). Every preset uses it, the Llama-3.2 shapes too (their published tokenizer differs).

Invariants:
- The config keeps the architecture's real, padded `vocab_size` (larger than the tokenizer, as Qwen's is), so
  parameter counts and memory are the published model's; small shapes pad the tokenizer's size to a multiple
  of 64.
- Deterministic: (name, seed) and the corpus file give byte-identical folders.
- At most one copy of the weights is in memory while building: the weights are written in shards of
  `SHARD_SIZE`, so serialising holds one shard's bytes beside the model.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedTokenizerFast, Qwen2Config

CORPUS_FILE = Path(__file__).with_name("bpe_corpus.txt")
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")  # added tokens, not special: decoded text keeps them
#: Trained vocabulary before the special tokens. The corpus is small; training stops earlier when no pair
#: repeats, so the real size is whatever the corpus supports (a few thousand).
BPE_VOCAB_SIZE = 4096
SHARD_SIZE = "200MB"
# Qwen2's pre-tokenizer: contractions, words with one leading non-letter, single digits, punctuation runs, newlines
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

#: Qwen2.5's chat template (its default system prompt replaced by the neutral one above).
CHATML_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    f"        {{{{- '{DEFAULT_SYSTEM_PROMPT}' }}}}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    f"        {{{{- '<|im_start|>system\\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\\n' }}}}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


@dataclass(frozen=True)
class Architecture:
    """One published (or published-family) transformer shape. `vocab_size` None: the tokenizer's size, padded."""

    family: str  # "qwen2" or "llama"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int
    rope_theta: float
    vocab_size: int | None
    rms_norm_eps: float
    dtype: str  # of the saved weights, as published
    rope_scaling: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

#: name -> shape. Published numbers from the models' config.json (Qwen/Qwen2.5-0.5B, meta-llama/Llama-3.2-1B).
ARCHITECTURES: dict[str, Architecture] = {
    # 494,032,768 parameters (136,134,656 of them the tied embedding)
    "qwen2.5-0.5b": Architecture("qwen2", 896, 24, 14, 2, 4864, 32768, 1_000_000.0, 151936, 1e-6, "bfloat16"),
    # 1,235,814,400 parameters (262,668,288 of them the tied embedding)
    "llama-3.2-1b": Architecture("llama", 2048, 16, 32, 8, 8192, 131072, 500_000.0, 128256, 1e-5, "bfloat16",
                                 _LLAMA3_ROPE, {"head_dim": 64}),
    # the same families at a size that trains on a CPU; with the trained tokenizer (446 tokens, padded to 448)
    # qwen2.5-tiny has 845,952 parameters, llama-3.2-tiny 1,041,536
    "qwen2.5-tiny": Architecture("qwen2", 128, 4, 4, 2, 384, 2048, 1_000_000.0, None, 1e-6, "float32"),
    # Qwen2's family at ~30M parameters (hidden 512, 8 layers): the small size of `benchmarks/bench_scale.py`
    "qwen2.5-small": Architecture("qwen2", 512, 8, 8, 2, 2048, 2048, 1_000_000.0, None, 1e-6, "bfloat16"),
    "llama-3.2-tiny": Architecture("llama", 128, 4, 4, 2, 512, 2048, 500_000.0, None, 1e-5, "float32",
                                   {**_LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 512}),
}
_LAYERS_SUFFIX = re.compile(r"^(?P<base>.+)-(?P<layers>[0-9]+)l$")


def bpe_preset_names() -> list[str]:
    """The architecture names (each also takes a `-<N>l` suffix)."""
    return sorted(ARCHITECTURES)


def is_bpe_preset(name: str) -> bool:
    """Whether `name` is an architecture name, with or without a `-<N>l` suffix (checked by `parse_bpe_preset`)."""
    match = _LAYERS_SUFFIX.match(name)
    return name in ARCHITECTURES or (match is not None and match["base"] in ARCHITECTURES)


def parse_bpe_preset(name: str) -> Architecture:
    """`NAME` or `NAME-<N>l` (NAME's shape with its first N layers, 1 <= N <= its layer count) -> its shape.
    Raises ValueError naming the choices."""
    match = _LAYERS_SUFFIX.match(name)
    base, layers = (match["base"], int(match["layers"])) if match and name not in ARCHITECTURES else (name, None)
    if base not in ARCHITECTURES:
        raise ValueError(f"unknown BPE model preset {name!r}; choose one of {bpe_preset_names()}, optionally with "
                         "a layer count suffix such as '-2l'")
    shape = ARCHITECTURES[base]
    if layers is None:
        return shape
    if not 1 <= layers <= shape.layers:
        raise ValueError(f"model preset {name!r}: {base} has {shape.layers} layers; ask for 1 to {shape.layers}")
    return replace(shape, layers=layers)


def build_bpe_tokenizer(corpus: list[str] | None = None, vocab_size: int = BPE_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """The tokenizer described in the module docstring, trained on `corpus` (default: the corpus file's lines)."""
    if corpus is None:
        corpus = CORPUS_FILE.read_text().splitlines()
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    # the options are written to tokenizer.json as Qwen2.5's are (the stubs of `tokenizers` omit them)
    byte_level: Any = decoders.ByteLevel
    tokenizer.decoder = byte_level(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_CALL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=IM_END, pad_token=ENDOFTEXT, bos_token=None, unk_token=None,
        padding_side="right", clean_up_tokenization_spaces=False, model_max_length=131072,
        chat_template=CHATML_TEMPLATE, split_special_tokens=False,
    )


def bpe_preset_config(name: str, tokenizer_size: int, pad_id: int, eos_id: int) -> PretrainedConfig:
    """The transformers config of preset `name` for a tokenizer of `tokenizer_size` tokens."""
    shape = parse_bpe_preset(name)
    vocab_size = shape.vocab_size if shape.vocab_size is not None else -(-tokenizer_size // 64) * 64
    if vocab_size < tokenizer_size:
        raise ValueError(f"model preset {name!r}: its vocabulary of {vocab_size} is smaller than the tokenizer's "
                         f"{tokenizer_size} tokens")
    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config}[shape.family]
    family_fields: dict[str, Any] = (
        {"use_sliding_window": False, "max_window_layers": shape.layers} if shape.family == "qwen2" else {})
    config: PretrainedConfig = config_class(
        vocab_size=vocab_size, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, intermediate_size=shape.intermediate,
        max_position_embeddings=shape.max_positions, rms_norm_eps=shape.rms_norm_eps, rope_theta=shape.rope_theta,
        rope_scaling=dict(shape.rope_scaling) if shape.rope_scaling else None, tie_word_embeddings=True,
        pad_token_id=pad_id, bos_token_id=None, eos_token_id=eos_id, dtype=shape.dtype,
        **family_fields, **shape.extra,
    )
    return config


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Save as the published Qwen2.5 folders are laid out: the chat template inside `tokenizer_config.json`, and a
    `tokenizer_class` every transformers version resolves (`PreTrainedTokenizerFast`: `tokenizer.json` as is)."""
    tokenizer.save_pretrained(out, save_jinja_files=False)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False, sort_keys=True) + "\n")


def build_bpe_preset(name: str, out_dir: str | Path, *, seed: int = 0) -> Path:
    """Create BPE preset `name` with random weights and save model, tokenizer and generation config to `out_dir`.

    Returns `out_dir`. A folder whose `asyncflow_preset.json` stamp matches is reused; the stamp covers the
    corpus, so editing the tasks' text rebuilds the tokenizer.
    """
    out = Path(out_dir)
    corpus_text = CORPUS_FILE.read_text()
    stamp = {"preset": name, "seed": seed, "tokenizer": "bpe-chatml",
             "corpus_sha256": hashlib.sha256(corpus_text.encode()).hexdigest()}
    stamp_file = out / "asyncflow_preset.json"
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        return out
    tokenizer = build_bpe_tokenizer(corpus_text.splitlines())
    config = bpe_preset_config(name, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[parse_bpe_preset(name).dtype]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # as the published instruct models: a turn ends at <|im_end|>, and <|endoftext|> ends a document
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    out.mkdir(parents=True, exist_ok=True)
    stamp_file.unlink(missing_ok=True)  # a half-written folder is never taken for a finished one
    model.save_pretrained(out, max_shard_size=SHARD_SIZE)
    del model
    save_tokenizer(tokenizer, out)
    stamp_file.write_text(json.dumps(stamp))
    return out
