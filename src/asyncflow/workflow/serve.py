"""`asyncflow serve MODEL`: which weights a model reference names, and the server over them.

Owns: resolving MODEL (a Hugging Face folder, `preset:NAME`, a run folder: its newest intact checkpoint,
or a checkpoint folder `RUN_DIR/checkpoints/step_N`) to the model folder and checkpoint it names
(`resolve_model_ref`, which `asyncflow eval` shares) and to a loaded model, its tokenizer, a served name and
the weight version it reports; building the engine, the `EngineService` and the app over them (with `replicas` > 1,
one engine and service per replica, each over its own copy of the weights, behind a `ReplicaRouter`).

Invariants: a checkpoint is verified against its manifest before its weights are served (a damaged file
is named), and its weights go into the architecture and tokenizer of the run's own `model.path`. The checkpoint
is held against the run's pruning while it loads (`checkpoint.pinned`), so serving a run that trains never
finds its checkpoint gone.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncflow.engines.base import SamplingParams, make_inference_engine
from asyncflow.engines.service import EngineService
from asyncflow.models.loading import (
    PRESET_PREFIX,
    ModelLoadError,
    eos_token_ids,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from asyncflow.workflow.checkpoint import CheckpointError, checkpoint_step, latest_checkpoint, load_weights, pinned
from asyncflow.workflow.run_folder import CONFIG_FILE

log = logging.getLogger(__name__)


@dataclass
class ServedWeights:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    weight_version: int


@dataclass(frozen=True)
class ModelRef:
    """What a model reference names, nothing loaded: the model folder to build from, and the checkpoint whose
    weights go into it (None: the folder's own weights)."""

    model_path: Path
    checkpoint: Path | None
    name: str
    weight_version: int


def resolve_model_ref(ref: str) -> ModelRef:
    """MODEL (see the module docstring) -> its `ModelRef`; a checkpoint's model folder is its run's `model.path`.
    Errors name what is missing."""
    path = Path(ref).expanduser()
    if ref.startswith(PRESET_PREFIX) or (path / "config.json").is_file():
        name = ref if ref.startswith(PRESET_PREFIX) else path.resolve().name
        return ModelRef(Path(resolve_model_path(ref)), None, name, 0)
    if not path.exists():
        raise ModelLoadError(f"{ref!r} does not exist")
    checkpoint = path
    if (path / CONFIG_FILE).is_file() and (path / "checkpoints").is_dir():
        latest = latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"run folder {ref!r} has no checkpoint yet")
        checkpoint = latest
    elif not (path / "model.safetensors").is_file():
        raise ModelLoadError(f"{ref!r} is neither a Hugging Face model folder, 'preset:NAME', a run folder nor a "
                             "checkpoint folder (RUN_DIR/checkpoints/step_N)")
    step = checkpoint_step(checkpoint)
    run_dir = checkpoint.parent.parent
    if not (run_dir / CONFIG_FILE).is_file():
        raise CheckpointError(f"{checkpoint}: its run folder {run_dir} has no {CONFIG_FILE} (the base model)")
    try:
        run_config = yaml.safe_load((run_dir / CONFIG_FILE).read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{run_dir / CONFIG_FILE}: damaged, not valid YAML ({str(err).splitlines()[0]}): "
                              "resume the run to write it again") from None
    if not isinstance(run_config, dict):
        raise CheckpointError(f"{run_dir / CONFIG_FILE}: damaged (not a mapping of config sections): resume the run "
                              "to write it again")
    base = run_config.get("model", {}).get("path")
    if not base:
        raise CheckpointError(f"{run_dir / CONFIG_FILE}: no model.path")
    seed = run_config.get("run", {}).get("seed", 0)
    model_path = Path(resolve_model_path(_base_path(str(base), run_dir), seed=seed))
    state_file = checkpoint / "state.json"
    version = int(json.loads(state_file.read_text()).get("version", step)) if state_file.is_file() else step
    return ModelRef(model_path, checkpoint, f"{run_dir.resolve().name}/step_{step}", version)


def load_served(ref: str, *, dtype: str = "float32", device: str = "cpu") -> ServedWeights:
    """The model MODEL names, loaded; see the module docstring. Errors name what is missing or damaged."""
    with pinned(lambda: resolve_model_ref(ref), lambda resolved: resolved.checkpoint) as resolved:
        weights = None if resolved.checkpoint is None else load_weights(resolved.checkpoint)  # verified first
    model = load_model(resolved.model_path, dtype=dtype, device=device)
    if weights is not None:
        model.load_state_dict(weights)
        log.info("serving %s (weight version %d) on %s", resolved.checkpoint, resolved.weight_version,
                 resolved.model_path)
    return ServedWeights(model, load_tokenizer(resolved.model_path), resolved.name, resolved.weight_version)


def _base_path(base: str, run_dir: Path) -> str:
    """The run's `model.path`; a relative one (written relative to where `train` ran, e.g. `runs/x/sft`) is also
    looked for under the run folder's ancestors, so the run can be served from another directory."""
    if base.startswith(PRESET_PREFIX) or Path(base).is_absolute() or Path(base).exists():
        return base
    for ancestor in run_dir.resolve().parents:
        if (ancestor / base).exists():
            return str(ancestor / base)
    return base


def build_app(weights: ServedWeights, *, api_key: str, name: str | None = None, engine: str = "torch",
              max_batch_size: int = 64, device: str = "cpu", seed: int = 0, chat_template: str | None = None,
              request_timeout_s: float = 600.0, recorder=None, limits=None, replicas: int = 1,
              engine_options: Mapping[str, Any] | None = None):
    """-> (app, service): the engine from the registry, one `EngineService` over it (an engine error fails the
    requests it was running, the next ones are served), the API over that (`recorder`: an `EpisodeRecorder` for
    the `/episodes/{id}/v1` routes; `limits`: `ServingLimits`, pass the same to the uvicorn runner). `replicas` > 1:
    that many engines (replica `r` samples with seed `seed + r`) behind a `ReplicaRouter`, which is `service`;
    `engine_options`: further keyword arguments of the engine's factory."""
    from asyncflow.serving.api import ServedModel, make_app
    from asyncflow.serving.router import ReplicaRouter

    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    model = weights.model.eval().requires_grad_(False)
    services = []
    for r in range(replicas):
        own = model if r == 0 else copy.deepcopy(model)
        inference = make_inference_engine(engine, model=own, max_batch_size=max_batch_size, device=device,
                                          seed=seed + r, weight_version=weights.weight_version,
                                          **(engine_options or {}))
        services.append(EngineService(inference, SamplingParams(), name=f"engine-service-{r}", restart_on_error=True))
    service: EngineService | ReplicaRouter = services[0] if replicas == 1 else ReplicaRouter(services)
    config = model.config
    served = ServedModel(
        name=name or weights.name, tokenizer=weights.tokenizer, service=service,
        max_model_len=int(getattr(config, "max_position_embeddings", 0) or weights.tokenizer.model_max_length),
        vocab_size=model.get_input_embeddings().num_embeddings, chat_template=chat_template,
        eos_token_ids=eos_token_ids(weights.tokenizer, getattr(model, "generation_config", None)),
    )
    return make_app(served, api_key=api_key, request_timeout_s=request_timeout_s, recorder=recorder,
                    limits=limits), service
