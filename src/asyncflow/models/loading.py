"""Loading causal LMs and tokenizers: the one code path for built-in presets and user models.

Owns: resolving a model reference (a local Hugging Face folder, or `preset:NAME` which is first
materialised as such a folder) and loading it with `AutoModelForCausalLM` / `AutoTokenizer`,
plus prompt rendering (chat template when the tokenizer has one), prompt lengths in bulk, and the
ids that end a sample (`eos_token_ids`: the tokenizer's EOS and the generation config's).

Invariant: presets are never special-cased after materialisation; they go through exactly the
same `from_pretrained` calls as any user model.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from asyncflow.models.presets import build_preset

PRESET_PREFIX = "preset:"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """A model reference that cannot be resolved or loaded."""


def resolve_model_path(ref: str, *, seed: int = 0, cache_dir: str | Path | None = None) -> Path:
    """Turn `preset:NAME` or a local folder into a local HF folder, checking it exists."""
    if ref.startswith(PRESET_PREFIX):
        name = ref[len(PRESET_PREFIX) :]
        cache = Path(cache_dir or os.environ.get("ASYNCFLOW_CACHE", str(Path.home() / ".cache" / "asyncflow")))
        return build_preset(name, cache / "presets" / f"{name}-seed{seed}", seed=seed)
    path = Path(ref).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"model path {ref!r} does not exist or is not a folder (model.path expects a local Hugging Face "
            f"model folder or 'preset:NAME'; downloading from a hub is not supported here)"
        )
    if not (path / "config.json").exists():
        raise ModelLoadError(f"model folder {str(path)!r} has no config.json; is it a Hugging Face model folder?")
    return path


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_generation_config(path: str | Path) -> GenerationConfig | None:
    """The folder's `generation_config.json`, or None when it has none."""
    if not (Path(path) / "generation_config.json").exists():
        return None
    return GenerationConfig.from_pretrained(str(path))


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, generation_config: GenerationConfig | None = None
                  ) -> tuple[int, ...]:
    """The ids that end a sample, without repeats: the tokenizer's EOS, then the generation config's
    `eos_token_id` (an int or a list: chat models list the end of a turn and the end of a document, as
    Qwen2.5-Instruct's `[<|im_end|>, <|endoftext|>]`; vLLM stops at all of them too)."""
    ids = [tokenizer.eos_token_id]
    listed = getattr(generation_config, "eos_token_id", None)
    ids += listed if isinstance(listed, list) else [listed]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def load_model(path: str | Path, *, dtype: str = "float32", device: str = "cpu", weights: bool = True
               ) -> PreTrainedModel:
    """The model folder's causal LM; `weights=False`: its architecture only (`from_config`, freshly initialised),
    for a caller that fills the weights itself."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"model.dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if not weights:
        config = AutoConfig.from_pretrained(str(path))
        built = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], attn_implementation="sdpa")
        return built  # type: ignore[no-any-return]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype], attn_implementation="sdpa")
    # transformers wraps PreTrainedModel.to with functools.wraps, which mypy reads as an unbound function
    return model.to(device)  # type: ignore[arg-type,no-any-return]


def model_on_meta(path: str | Path, *, dtype: str = "float32") -> PreTrainedModel:
    """The architecture of the model folder `path` on the meta device: its parameter names, shapes and ties, no
    memory."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"model.dtype {dtype!r} is not one of {sorted(DTYPES)}")
    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], attn_implementation="sdpa")
    return model  # type: ignore[no-any-return]


def model_with_weights(
    path: str | Path, weights: Mapping[str, torch.Tensor], *, dtype: str = "float32"
) -> PreTrainedModel:
    """The architecture of the model folder `path` holding `weights` (every key matched), built without loading the
    folder's own weights and without copying `weights`: the module is made on the meta device and takes the given
    tensors as its parameters (`assign`), tied weights tied again. For writing a model folder (`save_pretrained`)
    from weights held elsewhere, with one copy of them in memory; its non-persistent buffers (e.g. rotary
    frequencies) are left unallocated, so it is not for running."""
    model = model_on_meta(path, dtype=dtype)
    model.load_state_dict(dict(weights), strict=True, assign=True)
    model.tie_weights()
    return model


def render_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, use_chat_template: bool | None = None) -> list[int]:
    """Prompt text -> token ids. Uses the chat template when the tokenizer has one (unless disabled)."""
    if use_chat_template is None:
        use_chat_template = bool(getattr(tokenizer, "chat_template", None))
    if use_chat_template:
        templated = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(cast("list[int]", templated))  # one conversation, tokenized, no dict: its token ids
    ids: list[int] = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id] + ids
    return ids


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], chat_template: str | None = None,
                tools: list[dict[str, Any] | Callable[..., Any]] | None = None) -> list[int]:
    """Chat messages (and the `tools` offered) -> the ids a chat call's prompt has: the chat template
    (`chat_template`, else the tokenizer's) with the generation prompt, tokenized without special tokens added."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    text = tokenizer.apply_chat_template(messages, chat_template=template, tools=tools, tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(cast(str, text), add_special_tokens=False)["input_ids"])


def prompt_lengths(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], use_chat_template: bool | None = None, batch: int = 4096
) -> list[int]:
    """`len(render_prompt(tokenizer, p, use_chat_template))` for every prompt, tokenized in batches (fast enough
    to check a whole dataset before training)."""
    if use_chat_template is None:
        use_chat_template = bool(getattr(tokenizer, "chat_template", None))
    bos = 1 if tokenizer.bos_token_id is not None else 0
    lengths: list[int] = []
    for start in range(0, len(prompts), batch):
        chunk = list(prompts[start : start + batch])
        if use_chat_template:
            conversations = [[{"role": "user", "content": prompt}] for prompt in chunk]
            ids = cast("list[list[int]]", tokenizer.apply_chat_template(
                conversations, add_generation_prompt=True, tokenize=True, return_dict=False
            ))  # a batch, tokenized, no dict: token ids per conversation
            lengths.extend(len(one) for one in ids)
        else:
            lengths.extend(len(one) + bos for one in tokenizer(chunk, add_special_tokens=False)["input_ids"])
    return lengths
