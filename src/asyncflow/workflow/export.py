"""Exporting a run's policy as a Hugging Face folder: `asyncflow export RUN_DIR OUT` and the final export.

Owns: what an export folder holds, written from one checkpoint of a run:
- full fine-tuning (and LoRA with `merged`): `config.json`, `model.safetensors` and
  `generation_config.json` as `save_pretrained` writes them for the model's own architecture class
  (e.g. `LlamaForCausalLM`), plus the tokenizer of the model the run trained from (a `preset:NAME`'s
  character tokenizer, or the user's folder's). `AutoModelForCausalLM` / `AutoTokenizer` and vLLM load it.
- LoRA: the adapter in peft's format (`adapter_config.json`, `adapter_model.safetensors`, its
  `base_model_name_or_path` the folder the run trained from) with the tokenizer; with `merged`, the full
  model as above in OUT and the adapter in `OUT/adapter/`.
- `asyncflow_export.json`: the run folder, step and LoRA setting it came from.

Invariants:
- The weights are the checkpoint's `model.safetensors` (verified against its manifest), matched key for key
  against the run's architecture and copied one tensor at a time (`write_model`: the export never holds the
  model whole): a model loaded from OUT gives the trainer's log-probs exactly.
- OUT is written under a temporary name and renamed into place, so it is complete or absent; an existing
  non-empty OUT is never written into unless `replace` (the final export of a run replaces its own). A write
  that fails, whatever raised (a full disk named as such), removes the temporary folder and is one
  `ExportError` line.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import NoReturn

import torch
from transformers import AutoTokenizer

from asyncflow.config import load_config
from asyncflow.models.loading import model_on_meta, resolve_model_path
from asyncflow.weights.buckets import BucketStream, SafetensorsReader, plan_buckets, save_safetensors
from asyncflow.workflow.checkpoint import (
    CheckpointError,
    checkpoint_step,
    list_checkpoints,
    load_training_state,
    pinned,
    verify_checkpoint,
    write_failure,
)
from asyncflow.workflow.setup import lora_settings

log = logging.getLogger(__name__)

EXPORT_DIR = "export"  # RUN_DIR/export: the final export of a run
ADAPTER_DIR = "adapter"  # OUT/adapter: the LoRA adapter when the merged model fills OUT
INFO_FILE = "asyncflow_export.json"


class ExportError(ValueError):
    """An export that cannot be written: the message names the folder or checkpoint."""


def pick_checkpoint(run_dir: Path, step: int | None = None) -> Path:
    """`checkpoints/step_{step}`, or the newest checkpoint that verifies when `step` is None."""
    if step is not None:
        return Path(run_dir) / "checkpoints" / f"step_{step}"
    found = list_checkpoints(run_dir)
    for checkpoint in reversed(found):
        try:
            verify_checkpoint(checkpoint)
            return checkpoint
        except CheckpointError as err:
            log.warning("export: skipping the damaged checkpoint %s (%s)", checkpoint, err)
    raise ExportError(f"{run_dir}: no intact checkpoint to export" + (f" (damaged: {found})" if found else ""))


def write_model(model_path: Path, weights_file: Path, out: Path, *, dtype: str) -> None:
    """`config.json`, `generation_config.json` and `model.safetensors` of `model_path`'s architecture holding the
    tensors of `weights_file` (a checkpoint's), every key matched and tied duplicates written once, as
    `save_pretrained` writes them; the tensors are copied one at a time (read lazily): never the model whole."""
    model = model_on_meta(model_path, dtype=dtype)
    distinct: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        distinct.setdefault(id(tensor), name)
    with SafetensorsReader(weights_file) as f:
        held, wanted = set(f.keys()), set(model.state_dict())
        if held != wanted:
            extra, missing = sorted(held - wanted), sorted(wanted - held)
            raise ExportError(f"{weights_file} does not match {model_path}'s architecture (missing {missing[:3]}, "
                              f"unexpected {extra[:3]})")
        shapes = {name: torch.empty(f.entries[name][1], dtype=f.entries[name][0], device="meta")
                  for name in distinct.values()}
        manifest = plan_buckets(shapes, bucket_bytes=1, split=False)  # one tensor per bucket
        save_safetensors(BucketStream(manifest, lambda: ([f.get_tensor(e.name)] for e in manifest.tensors)),
                         out / "model.safetensors")
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(str(out))
    if model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(str(out))


def _failed(err: BaseException, tmp: Path, out: Path, run_dir: Path, checkpoint: Path) -> NoReturn:
    """Remove the half-written export and raise `err` as one `ExportError` line (an interruption as it is)."""
    cause = write_failure(err, tmp.parent)[1] if isinstance(err, Exception) else None  # before space is freed
    shutil.rmtree(tmp, ignore_errors=True)
    if cause is None or isinstance(err, ExportError):
        raise err
    raise ExportError(f"{cause} while writing the export {out} (from {checkpoint}); the run's checkpoints are "
                      f"intact: export again with asyncflow export {run_dir} {out}") from err


def export_run(
    run_dir: str | Path, out: str | Path, *, step: int | None = None, merged: bool = False, replace: bool = False
) -> Path:
    """Write the policy of `run_dir` at checkpoint `step` (default: the newest intact one) to `out`; -> `out`."""
    run_dir, out = Path(run_dir), Path(out)
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise ExportError(f"{run_dir} holds no run (no config.yaml)")
    if out.exists() and any(out.iterdir()) and not replace:
        raise ExportError(f"export folder {out} exists and is not empty: give a new folder")
    config = load_config(config_file)
    lora = lora_settings(config)
    model_path = resolve_model_path(config.model.path, seed=config.run.seed)
    tmp = out.parent / f".tmp_{out.name}"
    with pinned(lambda: pick_checkpoint(run_dir, step)) as checkpoint:  # not pruned by the run while it is read
        verify_checkpoint(checkpoint, files=("model.safetensors",))  # a damaged file is named
        adapter = load_training_state(checkpoint)["adapter"] if lora is not None else None
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            if lora is None or merged:  # every weight of the architecture, no more, one tensor at a time
                write_model(model_path, checkpoint / "model.safetensors", tmp, dtype=config.model.dtype)
        except BaseException as err:
            _failed(err, tmp, out, run_dir, checkpoint)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_path))  # as the run's model folder has it
        if lora is None or merged:
            tokenizer.save_pretrained(str(tmp))
        if lora is not None:
            from asyncflow.engines.peft_lora import save_adapter

            adapter_dir = tmp / ADAPTER_DIR if merged else tmp
            assert adapter is not None, "read with the LoRA settings above"
            save_adapter(adapter_dir, lora, adapter, base_model=str(model_path.resolve()))
            tokenizer.save_pretrained(str(adapter_dir))
        info = {
            "run_dir": str(run_dir.resolve()), "step": checkpoint_step(checkpoint), "base_model": str(model_path),
            "lora": None if lora is None else config.train.lora.model_dump(mode="json"),
            "merged": lora is None or merged,
        }  # fmt: skip
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException as err:
        _failed(err, tmp, out, run_dir, checkpoint)
    log.info("exported %s (step %d) to %s", checkpoint, info["step"], out)
    return out
