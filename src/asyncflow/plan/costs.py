"""Cost functions of one run's roles, and the profile file they come from.

Owns: `ModelShape` (what the costs need of a model: parameters, layers, hidden size, KV width), `Hardware`
(one accelerator's public specification), `Profile` (the file `asyncflow profile` writes and
`asyncflow plan --profile` reads) and `Costs` (seconds for each simulated action).

A profile is one of two kinds:
- `measured`: coefficients fitted on this machine for one model by `asyncflow profile` (`asyncflow.plan.measure`);
  they hold for that model only (`model` names it).
- `spec`: an accelerator's peak FLOP/s, memory bandwidth and interconnect from its public data sheet, with
  assumed efficiencies; `Costs.from_spec` turns them into coefficients for any `ModelShape` with the usual
  roofline estimates (decode: weights + KV cache read per step; prefill and training: 2 and 6 FLOPs per
  parameter per token). These are estimates, not measurements, and are marked `kind: spec`.

Invariants: every cost is >= 0 seconds and non-decreasing in its size argument; `Costs` is a plain frozen
record (cheap to pass to the simulator, picklable).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import yaml
from pydantic import BaseModel, Field

PROFILES_DIR = Path(__file__).parent / "profiles"
Seconds = TypeVar("Seconds", float, np.ndarray)  # a cost of one call, or element-wise of an array of calls


class ModelShape(BaseModel):
    """What the cost model needs of a decoder-only transformer."""

    params: float = Field(gt=0)
    """Parameter count."""
    layers: int = Field(ge=1)
    hidden: int = Field(ge=1)
    kv_dim: int = Field(ge=1)
    """Key (= value) width per layer: `num_key_value_heads * head_dim`."""
    bytes_per_param: float = 2.0
    """2 for bf16 weights in the engines, 4 for fp32."""

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_dim * self.bytes_per_param

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], bytes_per_param: float = 2.0) -> ModelShape:
        """From a Hugging Face `config.json` (Llama / Qwen style keys); parameters counted from the shapes."""
        h, L = config["hidden_size"], config["num_hidden_layers"]
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or h // heads
        kv = config.get("num_key_value_heads", heads) * head_dim
        inter, vocab = config["intermediate_size"], config["vocab_size"]
        per_layer = h * heads * head_dim * 2 + h * kv * 2 + 3 * h * inter
        embed = vocab * h * (1 if config.get("tie_word_embeddings") else 2)
        return cls(params=L * per_layer + embed, layers=L, hidden=h, kv_dim=kv, bytes_per_param=bytes_per_param)

    @classmethod
    def load(cls, ref: str) -> ModelShape:
        """`ref`: a `config.json` (or its folder), or `NB` / `NM` (a Qwen2.5-like shape of that size: `7B`)."""
        path = Path(ref)
        if path.is_dir():
            path = path / "config.json"
        if path.exists():
            return cls.from_hf_config(json.loads(path.read_text()))
        return qwen_like(ref)


QWEN_SHAPES = {  # Qwen2.5 sizes: (params, layers, hidden, kv heads x head dim)
    "0.5B": (0.49e9, 24, 896, 128), "1.5B": (1.5e9, 28, 1536, 256), "3B": (3.1e9, 36, 2048, 256),
    "7B": (7.6e9, 28, 3584, 512), "14B": (14.7e9, 48, 5120, 1024), "32B": (32.5e9, 64, 5120, 1024),
    "72B": (72.7e9, 80, 8192, 1024),
}  # fmt: skip


def qwen_like(size: str) -> ModelShape:
    """The Qwen2.5 model of `size` ("7B"); other sizes scale 7B's shape by the parameter ratio."""
    size = size.upper()
    if size in QWEN_SHAPES:
        p, L, h, kv = QWEN_SHAPES[size]
        return ModelShape(params=p, layers=L, hidden=h, kv_dim=kv)
    scale = {"B": 1e9, "M": 1e6}[size[-1]]
    params = float(size[:-1]) * scale
    p, L, h, kv = QWEN_SHAPES["7B"]
    return ModelShape(params=params, layers=L, hidden=h, kv_dim=int(kv * max(params / p, 0.05)))


class Hardware(BaseModel):
    """One accelerator from its public data sheet (dense bf16 peak, no sparsity)."""

    name: str
    peak_flops: float = Field(gt=0)
    """Dense bf16 FLOP/s."""
    memory_bw: float = Field(gt=0)
    """HBM bytes/s."""
    memory_gb: float = Field(gt=0)
    interconnect_bw: float = Field(gt=0)
    """Bytes/s one device sends to another (NVLink / HCCS inside a node)."""
    network_bw: float = Field(gt=0)
    """Bytes/s per device between nodes (InfiniBand / RoCE)."""
    devices_per_node: int = 8
    mfu_train: float = 0.40
    """Assumed fraction of peak FLOP/s training reaches (FSDP, bf16)."""
    train_flops_per_param_token: float = 8.0
    """FLOPs per parameter per trained token: policy forward + backward (6) and the reference forward (2) of
    the tri-model pass."""
    mfu_prefill: float = 0.50
    bw_efficiency: float = 0.70
    """Assumed fraction of memory bandwidth a decode step reaches."""
    decode_overhead_s: float = 0.004
    """Assumed fixed cost of one decode step (scheduler, kernel launches)."""
    source: str = ""
    """Where the figures come from."""


class Profile(BaseModel):
    """The file `asyncflow profile` writes (YAML or JSON). `kind: spec` profiles carry `hardware` only."""

    kind: Literal["measured", "spec"]
    name: str
    hardware: Hardware | None = None
    model: str = ""
    """measured: the model the coefficients hold for (`model.path` of the config profiled)."""
    decode_step_s: float = 0.0
    """measured: fixed seconds per decode step of the engine."""
    decode_row_s: float = 0.0
    """measured: seconds each active row adds to a decode step."""
    decode_row_token_s: float = 0.0
    """measured: seconds each token of context of each active row adds to a decode step."""
    prefill_token_s: float = 0.0
    """measured: seconds per prompt token of prefill."""
    prefill_row_s: float = 0.0
    """measured: seconds each admitted row adds to its prefill beyond its tokens (its slot, its first sample)."""
    train_micro_batch_s: float = 0.0
    """measured: fixed seconds per micro-batch (its read from the queue, forward + backward)."""
    train_token_s: float = 0.0
    """measured: seconds per token of an unpacked micro-batch (forward + backward), padding included."""
    train_packed_token_s: float | None = None
    """measured: seconds per token of a shared-prompt packed micro-batch (its layout runs a second attention
    call per layer); None: `train_token_s`."""
    optimizer_step_s: float = 0.0
    """measured: seconds of one optimizer step."""
    publish_s: float = 0.0
    """measured: fixed seconds of one weight publish."""
    publish_byte_s: float = 0.0
    """measured: seconds per byte published (and swapped into an engine)."""
    weight_bytes: float = 0.0
    """measured: bytes of the profiled model's weights (one version)."""
    reward_row_s: float = 0.0
    """measured: seconds to score one row."""
    queue_call_s: float = 0.0
    """measured: seconds of one TransferQueue call (a prompt read, a write of finished rows; the trainer's reads
    are in the training costs)."""
    put_prompts_s: float | None = None
    """measured: seconds the trainer takes to put a step's prompts (the prompt source's next batch, its partition
    created and appended); None (older profiles): `queue_call_s`."""
    host_cores: float = 0.0
    """measured on a CPU with `runtime.kind: ray`: the cores of the one host that the rollout replica, the trainer
    and the data plane's processes share; 0 (a GPU, the in-process queue, a spec): each role has its own
    devices."""
    background_cores: float = 0.0
    """measured with `host_cores`: cores the runtime's own processes (Ray's GCS, raylet, dashboard and agents, the
    queue's idle actors) take from that host while nothing is asked of them."""
    queue_beside_call_s: float = 0.0
    """measured with `host_cores`: of `queue_call_s`, the CPU seconds the local cluster's processes (the queue's
    actors) spend beside the caller: taken from the cores the roles share."""
    threads: int = 1
    notes: str = ""

    @classmethod
    def load(cls, ref: str | Path) -> Profile:
        """A profile file, or the name of a shipped one (`h100`, `a100`, `910b`)."""
        path = Path(ref)
        if not path.exists():
            path = PROFILES_DIR / f"{str(ref).lower()}.yaml"
        text = path.read_text()
        return cls.model_validate(json.loads(text) if path.suffix == ".json" else yaml.safe_load(text))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        data = self.model_dump(exclude_none=True)
        path.write_text(json.dumps(data, indent=2) if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False))
        return path


@dataclass(frozen=True)
class Costs:
    """Seconds for each simulated action of one rollout replica / the trainer (linear coefficients)."""

    decode_step_s: float
    decode_row_s: float
    decode_row_token_s: float
    prefill_token_s: float
    train_micro_batch_s: float
    train_token_s: float
    optimizer_step_s: float
    publish_s: float
    swap_s: float
    reward_row_s: float = 0.0
    queue_call_s: float = 0.0
    prefill_row_s: float = 0.0
    train_packed_token_s: float | None = None
    """Per token of a shared-prompt packed micro-batch; None: `train_token_s`."""
    put_prompts_s: float = 0.0
    """The trainer's seconds to put a step's prompts into the queue."""
    switch_s: float = 0.0
    """Colocated `sync` only: seconds per step to switch the devices between inference and training (offload /
    onload of weights and KV cache, resharding), twice per step in total."""
    host_cores: float = 0.0
    """`stream` / `async` on one host whose cores the roles share (`Profile.host_cores`); 0: no sharing."""
    background_cores: float = 0.0
    """Cores the runtime's own processes take from that host (`Profile.background_cores`)."""
    queue_beside_call_s: float = 0.0
    """CPU seconds of a queue call spent beside its caller, on that host (`Profile.queue_beside_call_s`)."""

    def stretched(self, rollout: float, train: float) -> Costs:
        """These costs with the rollout replica's compute (generation, scoring) `rollout` times and the trainer's
        (micro-batches, optimizer step) `train` times slower."""
        packed = None if self.train_packed_token_s is None else self.train_packed_token_s * train
        return replace(
            self, decode_step_s=self.decode_step_s * rollout, decode_row_s=self.decode_row_s * rollout,
            decode_row_token_s=self.decode_row_token_s * rollout, prefill_token_s=self.prefill_token_s * rollout,
            prefill_row_s=self.prefill_row_s * rollout, reward_row_s=self.reward_row_s * rollout,
            train_micro_batch_s=self.train_micro_batch_s * train, train_token_s=self.train_token_s * train,
            train_packed_token_s=packed, optimizer_step_s=self.optimizer_step_s * train,
        )  # fmt: skip

    def decode_step(self, active: float, context: float) -> float:
        return self.decode_step_s + active * (self.decode_row_s + context * self.decode_row_token_s)

    def prefill(self, prompt_tokens: Seconds, rows: Seconds) -> Seconds:
        """Seconds of a prefill; element-wise over arrays of prompt tokens and rows."""
        return prompt_tokens * self.prefill_token_s + rows * self.prefill_row_s

    def train(self, tokens: float, packed: bool = False) -> float:
        per_token = self.train_token_s
        if packed and self.train_packed_token_s is not None:
            per_token = self.train_packed_token_s
        return self.train_micro_batch_s + tokens * per_token

    @classmethod
    def from_profile(cls, profile: Profile, model: ModelShape | None = None, *, rollout_devices: int = 1,
                     train_devices: int = 1) -> Costs:
        """Costs of one replica of `rollout_devices` (tensor parallel) and of a trainer on `train_devices`."""
        if profile.kind == "spec":
            if model is None:
                raise ValueError("a spec profile needs a model shape")
            if profile.hardware is None:
                raise ValueError(f"profile {profile.name!r} is kind: spec but has no hardware")
            return cls.from_spec(profile.hardware, model, rollout_devices=rollout_devices, train_devices=train_devices)
        return cls(
            decode_step_s=profile.decode_step_s, decode_row_s=profile.decode_row_s,
            decode_row_token_s=profile.decode_row_token_s, prefill_token_s=profile.prefill_token_s,
            train_micro_batch_s=profile.train_micro_batch_s, train_token_s=profile.train_token_s,
            optimizer_step_s=profile.optimizer_step_s,
            publish_s=profile.publish_s + profile.publish_byte_s * profile.weight_bytes,
            swap_s=profile.publish_byte_s * profile.weight_bytes, reward_row_s=profile.reward_row_s,
            queue_call_s=profile.queue_call_s, prefill_row_s=profile.prefill_row_s,
            train_packed_token_s=profile.train_packed_token_s,
            put_prompts_s=profile.queue_call_s if profile.put_prompts_s is None else profile.put_prompts_s,
            host_cores=profile.host_cores, background_cores=profile.background_cores,
            queue_beside_call_s=profile.queue_beside_call_s,
        )  # fmt: skip

    @classmethod
    def from_spec(cls, hw: Hardware, model: ModelShape, *, rollout_devices: int = 1, train_devices: int = 1) -> Costs:
        """Roofline estimates. Decode step: read the weights once (split over the replica's devices) plus each
        active row's KV cache; prefill: 2 FLOPs per parameter per token; training:
        `train_flops_per_param_token` (forward + backward 6, the reference forward 2) over `train_devices`;
        optimizer: read + write fp32 master weights and two moments (16 bytes
        per parameter) over the training devices; publish: the bf16 weights over the network (one device's
        link when across nodes) and the swap the same bytes over the interconnect into each replica."""
        tp, bw = rollout_devices, hw.memory_bw * hw.bw_efficiency
        inter_node = train_devices >= hw.devices_per_node
        link = hw.network_bw * min(train_devices, hw.devices_per_node) if inter_node else hw.interconnect_bw
        return cls(
            decode_step_s=hw.decode_overhead_s + model.weight_bytes / (tp * bw),
            decode_row_s=2 * model.params / (tp * hw.peak_flops * hw.mfu_prefill),
            decode_row_token_s=model.kv_bytes_per_token / (tp * bw),
            prefill_token_s=2 * model.params / (tp * hw.peak_flops * hw.mfu_prefill),
            train_micro_batch_s=0.01,
            train_token_s=hw.train_flops_per_param_token * model.params
            / (train_devices * hw.peak_flops * hw.mfu_train),
            optimizer_step_s=16 * model.params / (train_devices * hw.memory_bw * hw.bw_efficiency) + 0.05,
            publish_s=0.1 + model.weight_bytes / link,
            swap_s=model.weight_bytes / (tp * hw.interconnect_bw),
        )  # fmt: skip
