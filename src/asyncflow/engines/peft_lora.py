"""LoRA adapters through peft: the only module of asyncflow that imports peft.

Owns: peft's config of `LoRASettings` (`peft_config`; the settings are `asyncflow.engines.base`'s), wrapping
a policy with adapters (`add_adapters`), the merged weights (`merged_state_dict`: base + alpha/r * B @ A under
the base model's own parameter names, what a rollout engine loads under `train.lora.sync: merged`), the
adapter's own tensors (`adapter_state_dict`, `load_adapter_state_dict`; under `adapter` what a rollout engine
takes, the built-in engine wrapping its base model here too and copying them in with `copy_adapter`), a pool of
adapters applied row by row in one batch (`adapter_pool`, `row_adapters`: the built-in engine's requests on
different versions), and writing an adapter folder in peft format (`save_adapter`).

Invariants:
- After `add_adapters` only adapter parameters require grad; the base weights are never changed by
  training (an optimizer built from `requires_grad` parameters holds the adapters alone).
- `merged_state_dict(model)` has exactly the keys and shapes of the model's state dict before
  `add_adapters`, so any engine that loads full weights of that architecture loads it. With B = 0 (a
  fresh adapter) it equals the base weights bit for bit.
- The model keeps its own class and `forward` (peft injects layers in place); the training code runs it
  as it runs any policy.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer

from asyncflow.engines.base import LoRASettings  # where callers of this module also find it

ADAPTER = "default"  # peft's adapter name; a policy carries one adapter
LoRAWrapper = PeftModel
"""peft's wrapper of a model with adapters (what `add_adapters` returns), named here so that callers type it
without importing peft."""



def peft_config(settings: LoRASettings, base_model_name_or_path: str | None = None) -> LoraConfig:
    """peft's `LoraConfig` of `settings`."""
    targets = settings.target_modules if isinstance(settings.target_modules, str) else list(settings.target_modules)
    # peft annotates lora_alpha as int; it is a scale (alpha / r) and takes any number
    return LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha,  # type: ignore[arg-type]
        lora_dropout=settings.dropout, target_modules=targets,
        task_type="CAUSAL_LM", base_model_name_or_path=base_model_name_or_path,
    )  # fmt: skip


def add_adapters(model: torch.nn.Module, settings: LoRASettings) -> PeftModel:
    """Inject LoRA adapters into `model` in place and freeze its base weights; -> the peft wrapper (for saving).

    `model` itself stays the module to train and run (same class and forward). Raises `ValueError` naming
    `train.lora.target_modules` when none of them is in the model."""
    try:
        with warnings.catch_warnings():  # peft asks transformers 5 about gradient checkpointing the old way
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            return get_peft_model(model, peft_config(settings))
    except ValueError as err:
        raise ValueError(f"train.lora.target_modules={settings.target_modules!r}: {err}") from None


def lora_layers(model: torch.nn.Module) -> dict[str, LoraLayer]:
    """Module path (in `model`) -> LoRA layer."""
    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of the adapted `model` as one plain model of its architecture: for every LoRA layer
    `weight = base_weight + alpha/r * B @ A`; every other tensor as it is. Keys as before `add_adapters`."""
    merged = {k.replace(".base_layer.", "."): v.detach() for k, v in model.state_dict().items() if ".lora_" not in k}
    for name, layer in lora_layers(model).items():
        weight = cast(torch.Tensor, layer.get_base_layer().weight)
        # each concrete LoRA layer (Linear, Embedding, Conv) defines get_delta_weight; peft's LoraLayer base does not
        delta: torch.Tensor = layer.get_delta_weight(ADAPTER)  # type: ignore[attr-defined]
        merged[f"{name}.weight"] = weight + delta.to(weight.dtype)
    return merged


def adapter_state_dict(wrapper: PeftModel) -> dict[str, torch.Tensor]:
    """The adapter's tensors, in peft's saved naming (what `adapter_model.safetensors` holds)."""
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(wrapper, adapter_name=ADAPTER).items()}


def load_adapter_state_dict(wrapper: PeftModel, tensors: dict[str, torch.Tensor]) -> None:
    """Restore `adapter_state_dict` output into `wrapper`; every adapter tensor must be given."""
    # torch's _IncompatibleKeys (missing_keys, unexpected_keys): a namedtuple mypy cannot resolve
    result: Any = set_peft_model_state_dict(wrapper, tensors, adapter_name=ADAPTER)
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"adapter tensors do not match the model: missing {missing[:3]}, "
                         f"unexpected {list(result.unexpected_keys)[:3]}")


def adapter_parameters(wrapper: PeftModel, adapter: str = ADAPTER) -> dict[str, torch.Tensor]:
    """The parameters of peft adapter `adapter` themselves under the names `adapter_state_dict` gives them (A/B of
    every LoRA layer)."""
    # module paths in the wrapper are `base_model.model.<path in the model>`, as in the saved names
    return {f"{name}.{part}.weight": cast(torch.Tensor, getattr(layer, part)[adapter].weight)
            for name, layer in lora_layers(wrapper).items() for part in ("lora_A", "lora_B")}


def adapter_pool(wrapper: PeftModel, settings: LoRASettings, size: int) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """`size` adapters of `settings` in `wrapper` (`add_adapters` output; its own adapter first, the others added):
    -> each one's peft name and `adapter_parameters`. A batch mixes them row by row through `row_adapters`."""
    names = [ADAPTER] + [f"slot{i}" for i in range(1, size)]
    for name in names[1:]:
        wrapper.add_adapter(name, peft_config(settings))
    return [(name, adapter_parameters(wrapper, name)) for name in names]


def row_adapters(model: torch.nn.Module, names: Callable[[], list[str] | None]) -> None:
    """Make every LoRA layer of `model` apply, to row i of its input, the adapter `names()[i]` (peft's mixed-batch
    forward: rows grouped by adapter, `y = base(x) + alpha/r * B_i(A_i(x))`); `names()` is read at every layer
    call, None there runs peft's active adapter on every row."""

    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        current = names()
        return (args, kwargs) if current is None else (args, {**kwargs, "adapter_names": current})

    for layer in lora_layers(model).values():  # peft's LoRA layers are modules (LoraLayer itself is a mixin)
        cast(torch.nn.Module, layer).register_forward_pre_hook(hook, with_kwargs=True)


def match_adapter(parameters: dict[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    """ValueError unless `tensors` (`adapter_state_dict` output) has exactly the names and shapes of `parameters`."""
    if tensors.keys() != parameters.keys():
        missing, unexpected = sorted(parameters.keys() - tensors.keys()), sorted(tensors.keys() - parameters.keys())
        raise ValueError(f"adapter tensors do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for name, parameter in parameters.items():
        if tensors[name].shape != parameter.shape:
            raise ValueError(f"adapter tensor {name}: shape {tuple(tensors[name].shape)}, the model's is "
                             f"{tuple(parameter.shape)} (train.lora.rank or target_modules differ)")


@torch.no_grad()
def copy_adapter(parameters: dict[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy `tensors` (checked by `match_adapter`) into `parameters` (`adapter_parameters`) in place: one copy per
    tensor, no walk over the model (what a rollout engine does per version)."""
    for name, parameter in parameters.items():
        parameter.copy_(tensors[name])


@torch.no_grad()
def reset_adapters(model: torch.nn.Module) -> None:
    """Zero every B matrix: the adapted model then computes exactly its base weights."""
    for layer in lora_layers(model).values():
        cast(torch.Tensor, layer.lora_B[ADAPTER].weight).zero_()


def save_adapter(out: Path, settings: LoRASettings, tensors: dict[str, torch.Tensor], base_model: str) -> None:
    """Write `adapter_config.json` + `adapter_model.safetensors` (peft's format) for `base_model` (a folder)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    peft_config(settings, base_model_name_or_path=base_model).save_pretrained(str(out))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
