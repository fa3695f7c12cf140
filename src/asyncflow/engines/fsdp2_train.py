"""The FSDP2 training engine (`train.engine: fsdp2`): the policy sharded over N ranks with
`torch.distributed.fsdp.fully_shard`, driven from the trainer's process like the built-in engine.

Owns: the driver-side `FSDP2TrainEngine` (implements `TrainEngine`), the rank-side `RankTrainer`
(one per rank, the same code whether the ranks are torch multiprocessing processes or Ray actors),
the `RankGroup` / `Launcher` interface through which a runtime starts the ranks (as local processes:
`asyncflow.runtime.inline`; as Ray actors: `asyncflow.runtime.ray_runtime`), the split of a micro-batch over the
ranks (`assign_rows`), the full weights streamed from the ranks one bucket at a time, and the sharded
checkpoint (torch.distributed.checkpoint) of weights and optimizer.

How a step runs: the driver splits each micro-batch over the ranks, balanced by forward tokens and
keeping GRPO groups whole when packing may use them (`assign_rows`); each rank runs the tri-model
forward on its rows, the loss object's `select` of those rows (`RowLoss`), and backpropagates the
loss SUM. Gradients are SUMMED across ranks (`set_force_sum_reduction_for_comms`), so after the
trainer's `optimizer_step(grad_scale=1 / global tokens or sequences)` they are exactly the
gradients one process computes on the whole batch, whatever the ranks' token counts: every
`algo.loss_agg` mode is a per-row sum divided by a count of the whole step (see
`asyncflow.algos.losses`), and the driver, which sees every row, knows that count.

Invariants:
- Every rank runs the same sequence of collectives: each micro-batch is a forward and backward on
  every rank (a rank given no rows runs a zero-weighted forward on a one-token dummy), and a
  non-finite loss on any rank skips the step on all ranks (the flag is all-reduced).
- Each call to the ranks and every collective is bounded by `timeout_s`; a rank that dies or fails
  ends the call with `RankFailedError` naming the rank, and the other ranks are stopped.
- Weights leave the ranks one bucket at a time (`weight_stream`: the ranks all-gather one parameter at a
  time, or send rank 0 their rows of a slice of one larger than a bucket; rank 0 copies each into the bucket, cast to
  the receiving engine's dtype, and sends it to the driver as one flat tensor over the bucket pipe, a two-process
  gloo group of rank 0 and the driver, never through the launcher's replies: Ray's object store would leave every
  bucket's pages mapped in both processes): no rank holds more than one bucket and the part being copied in
  (`weights/gather_peak_bytes`), the driver the bucket in transit. A `torch_distributed` publisher forwards the
  stream bucket by bucket, the others copy it into their own snapshot; a tied embedding goes to a publisher once
  (`distinct`); `state_dict` (checkpoints, evaluation) builds this process's copy once per version and caches it
  until the next `optimizer_step` or load.
- No rank holds the whole model at start: each builds it on the meta device, shards it, and the weights arrive one
  tensor at a time (rank 0 reads the folder's safetensors lazily and broadcasts; `stream_into_shards`), in the
  model's dtype; tied parameters stay one parameter. A critic or teacher run, and a folder whose tensor names
  `from_pretrained` converts (fused MoE experts), load the whole model through `from_pretrained`.
- A rank's freed buffers of 1 MiB or more leave its resident size (`return_freed_blocks`): glibc would otherwise keep
  freed layer-sized buffers in its heap, 1.3 to 1.8 GiB per rank at 0.5B (docs/rehearsal.md).
- Sharded checkpoints (`save_sharded` / `load_sharded`) hold every rank's weights and optimizer
  state; DCP reshards them on load, so a checkpoint resumes with another `world_size` too.
- A critic (`RankSpec.critic`) is attached to every rank's policy before sharding, is an FSDP2 unit of its own,
  and is trained, clipped and checkpointed (in `sharded/`) with the policy; the full state dict stays the policy's.
- `precision="bf16"` is FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: each unit's
  all-gathered parameters and its compute are bfloat16, gradients are reduced in float32 into float32
  shards, and AdamW steps float32 master weights; the full state dict is float32.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, fields
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from asyncflow.engines.base import LossFn, RowLoss, TrainEngineBase, register_train_engine
from asyncflow.engines.torch_train import (
    check_precision,
    clip_and_step,
    enable_activation_checkpointing,
    make_optimizer,
)
from asyncflow.models.loading import load_model
from asyncflow.models.logprobs import TrainSample
from asyncflow.models.moe import RouterReplay, capture_routers, router_loss
from asyncflow.models.tri_model import Packing, make_reference, tri_model_logprobs
from asyncflow.models.value import CriticSpec, attach_critic, critic_of, policy_weights
from asyncflow.observe.memory import METRIC_PREFIX as MEMORY_METRIC_PREFIX
from asyncflow.observe.memory import peak_rss_mb, return_freed_blocks
from asyncflow.transfer.samplers import karmarkar_karp
from asyncflow.weights.buckets import (
    DEFAULT_BUCKET_BYTES,
    BucketStream,
    Manifest,
    SafetensorsReader,
    allocate_payload,
    bucket_views,
    cast_manifest,
    plan_buckets,
    unpack,
    write_weights,
)
from asyncflow.weights.torch_distributed import make_group


class RankFailedError(ChildProcessError):
    """A training rank died, failed or did not answer in time; the message names the rank and the call (an
    `OSError`: the command line reports it in one line)."""


# ------------------------------------------------------------------------------------------- the split
def assign_rows(samples: Sequence[TrainSample], world: int, *, keep_groups: bool = True) -> list[list[int]]:
    """Split a micro-batch's rows over `world` ranks, balanced by forward tokens; -> each rank's row indices
    (in the micro-batch's order).

    Units are the runs of consecutive rows sharing a `group_id` when `keep_groups` (shared-prompt packing
    runs a group's prompt once, so a unit costs `P + sum R` tokens) and single rows otherwise (`P + R`).
    The units are split by the Karmarkar-Karp largest differencing method (`transfer.samplers.karmarkar_karp`).
    With fewer groups than ranks the rows are split individually, so every rank has work whenever there are
    `world` rows."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    units: list[list[int]] = []
    for i, sample in enumerate(samples):
        if keep_groups and units and samples[units[-1][0]].group_id == sample.group_id:
            units[-1].append(i)
        else:
            units.append([i])
    if keep_groups and len(units) < world <= len(samples):
        units = [[i] for i in range(len(samples))]

    def cost(unit: list[int]) -> int:
        return len(samples[unit[0]].prompt_ids) + sum(len(samples[i].response_ids) for i in unit)

    parts = karmarkar_karp([cost(unit) for unit in units], world)
    return [sorted(i for u in part for i in units[u]) for part in parts]


# ------------------------------------------------------------------------------------------- one rank
@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to build its part of the engine (picklable; sent to every rank)."""

    model_path: str
    dtype: str = "float32"
    device: str = "cpu"  # "cpu" or "cuda": rank r uses its local GPU
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = 1.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1
    use_reference: bool = False
    packing: Packing = "auto"
    threads: int = 1
    timeout_s: float = 600.0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    precision: str = "fp32"  # "fp32" or "bf16" (mixed: bf16 compute, fp32 reduce and master weights)
    activation_checkpointing: bool = False
    teacher_path: str | None = None  # on-policy distillation: the frozen teacher, in the reference's place
    critic: CriticSpec | None = None  # PPO's value model, attached to the policy (`asyncflow.models.value`)
    router_aux_loss_coef: float | None = None  # MoE: the load-balancing loss's weight (`asyncflow.models.moe`)
    router_replay: bool = False  # MoE: route as the rows' recorded experts say (`algo.router_replay`)


def shard_model(model: torch.nn.Module, mesh: Any, **options: Any) -> torch.nn.Module:
    """FSDP2: one unit per decoder layer (the classes HF lists in `_no_split_modules`), the critic (when attached:
    it runs outside the policy's forward), then the root (embeddings, final norm, head). Returns the same module,
    now sharded."""
    from torch.distributed.fsdp import fully_shard

    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, mesh=mesh, **options)
    critic = critic_of(model)
    if critic is not None:
        fully_shard(critic, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


@contextmanager
def parameters_on_meta(enabled: bool = True) -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no initialisation cost) and their
    buffers as usual: non-persistent buffers such as rotary frequencies are computed at build time, never loaded."""
    if not enabled:
        yield
        return
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def weight_files(model_path: str) -> dict[str, Path] | None:
    """Tensor name -> the safetensors file of `model_path` holding it; None when the folder has no safetensors
    weights (then the ranks load it whole, through `from_pretrained`)."""
    folder = Path(model_path)
    found: dict[str, Path] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with SafetensorsReader(file) as f:
            found.update(dict.fromkeys(f.keys(), file))
    return found or None


def stream_into_shards(models: Sequence[torch.nn.Module], files: Mapping[str, Path], rank: int,
                       device: torch.device) -> int:
    """Fill sharded `models` (built by `parameters_on_meta`, then `fully_shard`) with the weights of `files`, one
    tensor at a time: rank 0 reads it (`SafetensorsReader`, unmapped) and broadcasts it, every rank keeps its shard
    of it. A collective. Tied parameters are one parameter and load once. -> the most bytes of whole tensors this
    rank held at once (one tensor's)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    for model in models:
        buffers = {name: b.clone() for name, b in model.named_buffers()}  # computed at build; to_empty drops them
        model.to_empty(device=device)
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
    params = [dict(model.named_parameters()) for model in models]
    missing = sorted(set(params[0]) - set(files))
    if missing:
        raise ValueError(f"the model folder's safetensors files hold no tensor {missing[0]!r} "
                         f"({len(missing)} missing): cannot load it into FSDP2's shards")
    opened: dict[Path, SafetensorsReader] = {}
    peak = 0
    with ExitStack() as files_open:
        for name, param in params[0].items():
            full = torch.empty(param.shape, dtype=param.dtype, device=device)
            if rank == 0:
                file = files[name]
                if file not in opened:
                    opened[file] = files_open.enter_context(SafetensorsReader(file))
                full.copy_(opened[file].get_tensor(name))
            dist.broadcast(full, src=0)
            peak = max(peak, full.nbytes)
            with torch.no_grad():
                for model_params in params:
                    target = model_params[name]
                    if isinstance(target, DTensor):
                        target.copy_(distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None))
                    else:
                        target.copy_(full)
            del full
    return peak


class RankTrainer:
    """One rank: its shard of the policy (and reference), AdamW over the shards, the LR schedule.
    Every method is a collective: the driver calls it on every rank at once."""

    def __init__(self, rank: int, world: int, master_addr: str, master_port: int, spec: RankSpec) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

        self.rank, self.world, self.spec, self.host = rank, world, spec, master_addr
        return_freed_blocks()  # before any weights: freed layer-sized buffers leave the resident size
        if spec.device == "cpu":
            torch.set_num_threads(spec.threads)
            if master_addr in ("127.0.0.1", "localhost"):
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            self.device = torch.device("cpu")
        else:
            local = rank % max(1, torch.cuda.device_count())
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        dist.init_process_group(
            "gloo" if self.device.type == "cpu" else "nccl", init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank, world_size=world, timeout=timedelta(seconds=spec.timeout_s),
        )
        self.mesh = init_device_mesh(self.device.type, (world,))
        # Built on the meta device and filled tensor by tensor once sharded (`stream_into_shards`): no rank holds the
        # whole model. A critic or teacher is built from loaded weights (`from_pretrained`), as before.
        files = None if spec.critic is not None or spec.teacher_path is not None else weight_files(spec.model_path)
        with parameters_on_meta(files is not None):
            policy = load_model(spec.model_path, dtype=spec.dtype, device="cpu", weights=files is None)
        if files is not None and not set(dict(policy.named_parameters())) <= set(files):
            # the folder's names are not the model's (converted on load, e.g. fused MoE experts): load it whole
            files, policy = None, load_model(spec.model_path, dtype=spec.dtype, device="cpu")
        check_precision(spec.precision, policy)
        reference = make_reference(policy) if spec.use_reference else None
        if spec.teacher_path is not None:  # on-policy distillation: the teacher takes the reference's place
            reference = load_model(spec.teacher_path, dtype=spec.dtype, device="cpu").eval().requires_grad_(False)
        if spec.activation_checkpointing:  # before sharding
            enable_activation_checkpointing(policy, spec.packing)
        if spec.critic is not None:
            attach_critic(policy, spec.critic)
        # bf16 parameters in forward/backward, float32 gradient reduction: the shards (AdamW's master weights) stay fp32
        bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        precision: dict[str, Any] = {"mp_policy": bf16} if spec.precision == "bf16" else {}
        self.router_loss = router_loss(policy, spec.router_aux_loss_coef)  # before sharding: the modules stay
        self.replay = RouterReplay(policy) if spec.router_replay else None  # hooks on the modules, which sharding keeps
        self.model = shard_model(policy, self.mesh, **precision)
        for module in self.model.modules():  # the ranks' gradient sums add up; the driver normalises them
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
                module.set_gradient_divide_factor(1.0)
        self.model.train()
        self.reference = shard_model(reference, self.mesh, **precision) if reference is not None else None
        self.load_peak_bytes = 0  # the most bytes of whole (unsharded) tensors held at once while loading
        if files is not None:
            sharded = [self.model] + ([self.reference] if self.reference is not None else [])
            self.load_peak_bytes = stream_into_shards(sharded, files, self.rank, self.device)
        # The optimizer is built after sharding: over the DTensor shards (built before, it would not train).
        self.critic = critic_of(self.model)
        self.optimizer, self.scheduler = make_optimizer(
            self.model, spec.critic, spec.lr, spec.betas, spec.weight_decay, spec.lr_schedule, spec.warmup_steps,
            spec.total_steps,
        )
        self.nonfinite = False
        # the weight stream of the version being gathered (`weights_manifest`, `gathered_bucket`)
        self._sharded: dict[str, torch.Tensor] = {}
        self._manifest = Manifest((), (), 0)
        self._gather_peak_bytes = 0
        self._pipe: Any = None  # rank 0's end of the bucket pipe to the driver (`open_pipe`)
        self._pipe_opening: threading.Thread | None = None

    def backward(self, samples: list[TrainSample], loss_fn: RowLoss | None, temperature: float) -> dict[str, float]:
        """Forward + backward this rank's rows; -> the loss function's stats plus `loss` (sums over these rows).
        `samples` empty: a forward on a dummy row with zero weight, so the collectives stay in step."""
        rows = samples or [TrainSample([0], [0])]
        with capture_routers(self.router_loss) as routed:
            out = tri_model_logprobs(
                self.model, rows, reference=self.reference, packing=self.spec.packing,
                temperature=temperature, with_entropy=True, critic=self.critic, replay=self.replay,
            )
        if not samples:
            dummy = out.policy.logprobs.sum() * 0.0
            ((dummy + out.values.sum() * 0.0) if out.values is not None else dummy).backward()
            return {}
        assert loss_fn is not None  # the driver sends a loss with every non-empty share
        loss, stats = loss_fn(out)
        stats = {**stats, "train/packed_fraction": float(out.policy.mask.sum()) if out.packed else 0.0}
        if self.router_loss is not None:
            extra, moe_stats = self.router_loss.term(routed, out.policy.mask.sum())
            loss, stats = loss + extra, {**stats, **moe_stats}
        if not torch.isfinite(loss):
            self.nonfinite = True  # still backpropagated: every rank must run the same reduce-scatters
        loss.backward()
        return {**stats, "loss": float(loss.detach())}

    @torch.no_grad()
    def logprobs(self, samples: list[TrainSample], temperature: float) -> torch.Tensor:
        """Policy log-probs `[n, L]` (float32, on CPU) of this rank's rows, without gradient; a rank with no rows runs
        the dummy row (every rank must join the forward's all-gathers) and returns `[0, 0]`."""
        out = tri_model_logprobs(self.model, samples or [TrainSample([0], [0])], packing=self.spec.packing,
                                 temperature=temperature, replay=self.replay)
        return out.policy.logprobs.cpu() if samples else torch.zeros(0, 0)

    def step(self, grad_scale: float) -> dict[str, float]:
        """Scale the summed gradient shards, clip by the global norm, step (all ranks skip together)."""
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self.nonfinite else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stats = clip_and_step(self.model, self.optimizer, self.scheduler, grad_scale, self.spec.grad_clip,
                              skip=bool(flag.item()))
        self.nonfinite = False
        return stats

    def weights_manifest(self, bucket_bytes: int, distinct: bool = False, dtype: torch.dtype | None = None
                         ) -> Manifest | None:
        """Plan this version's weight stream: the layout (`plan_buckets`) of the full policy state dict, from the
        shards' global shapes, nothing gathered, with floating tensors wider than `dtype` carried in it
        (`cast_manifest`: what the receiving engine takes); -> the manifest on rank 0, None elsewhere. Every rank
        keeps it (and the sharded state dict) for `gathered_bucket`. `distinct`: a tied parameter under its first name
        only."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        # the sharded state dict: DTensors under the names of the full one (checkpoint wrappers' prefixes removed)
        self._sharded = policy_weights(cast("dict[str, torch.Tensor]", get_model_state_dict(self.model)))
        if distinct:  # a tied parameter is one module parameter under two names, on every rank alike
            first: dict[int, str] = {}
            tied = {name.replace("_checkpoint_wrapped_module.", "")
                    for name, p in self.model.named_parameters(remove_duplicate=False)
                    if first.setdefault(id(p), name) != name}
            self._sharded = {name: t for name, t in self._sharded.items() if name not in tied}
        shapes = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in self._sharded.items()}
        # planned in the trainer's dtype, so a bucket is at most `bucket_bytes` on the ranks too
        self._manifest = cast_manifest(plan_buckets(shapes, bucket_bytes), dtype)
        self._gather_peak_bytes = 0
        return self._manifest if self.rank == 0 else None

    def gathered_bucket(self, index: int) -> int:
        """Gather bucket `index` of `weights_manifest`'s plan, one tensor (or row slice of a split one) at a time (a
        collective), into one flat CPU tensor in the plan's dtype on rank 0, which sends it to the driver over the
        bucket pipe (`open_pipe`); -> the most bytes this rank has held at once for it since the plan (the bucket and
        the part being copied in). The other ranks hold one whole tensor (at most a bucket) or their rows of a slice
        at a time."""
        layout = self._manifest.buckets[index]
        flat = torch.empty(layout.numel, dtype=layout.dtype) if self.rank == 0 else None
        held = layout.nbytes if self.rank == 0 else 0
        for entry in self._manifest.tensors:
            if entry.bucket != index:
                continue
            part = self._gathered(self._sharded[entry.name], entry.rows)
            if part is None:
                continue
            self._gather_peak_bytes = max(self._gather_peak_bytes, held + part.nbytes)
            if flat is not None:
                flat[entry.offset : entry.offset + entry.numel].copy_(part.reshape(-1))  # the cast, if any
            del part
        if flat is not None:
            self._pipe_joined()
            self._pipe.send([flat], 1, 0).wait(timedelta(seconds=self.spec.timeout_s))
        return self._gather_peak_bytes

    def open_pipe(self) -> tuple[str, int] | None:
        """Rank 0: listen for the driver's end of the bucket pipe, a two-process gloo group over which
        `gathered_bucket` sends each bucket; -> (host, port) for the driver's `TCPStore`. The group is
        built on a thread of its own (both ends must be joining at once) and joined before the first send. Other
        ranks: None."""
        import torch.distributed as dist

        if self.rank != 0:
            return None
        store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=self.spec.timeout_s))

        def build() -> None:
            self._pipe = make_group(store, 0, 2, "gloo", self.spec.timeout_s)

        self._pipe_opening = threading.Thread(target=build, name="bucket-pipe", daemon=True)
        self._pipe_opening.start()
        return self.host, store.port

    def _pipe_joined(self) -> None:
        if self._pipe_opening is not None:
            self._pipe_opening.join(self.spec.timeout_s)
            if self._pipe is None:
                raise RuntimeError(f"rank 0: the driver did not join the bucket pipe within {self.spec.timeout_s} s")
            self._pipe_opening = None

    def _gathered(self, tensor: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor | None:
        """The whole `tensor` (`rows` None: every rank gets it) or its `rows` (rank 0 gets them, None elsewhere) on
        the CPU. A slice of a dim-0 sharded DTensor (FSDP2's layout) travels as each rank's own rows of it, sent to
        rank 0: no rank gathers the whole tensor."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor, Shard

        if not isinstance(tensor, DTensor):
            whole = tensor.detach().cpu()
            return whole if rows is None else whole[rows[0] : rows[1]]
        if rows is None:
            return tensor.full_tensor().detach().cpu()
        if tuple(tensor.placements) != (Shard(0),):  # not FSDP2's layout: gathered whole (a collective), then cut
            whole = tensor.full_tensor().detach()
            return whole[rows[0] : rows[1]].cpu() if self.rank == 0 else None
        local = tensor.to_local().detach()
        chunk = -(-tensor.shape[0] // self.world)  # torch.chunk's split, as Shard(0) places rows
        start = min(self.rank * chunk, tensor.shape[0])
        if local.shape[0] != min(chunk, tensor.shape[0] - start):
            raise RuntimeError(f"rank {self.rank}: a shard of {local.shape[0]} rows where Shard(0) places "
                               f"{min(chunk, tensor.shape[0] - start)}")
        out = torch.empty((rows[1] - rows[0], *local.shape[1:]), dtype=local.dtype, device=local.device) \
            if self.rank == 0 else None
        for owner in range(self.world):
            lo, hi = max(rows[0], owner * chunk), min(rows[1], (owner + 1) * chunk, tensor.shape[0])
            if lo >= hi:
                continue
            if owner == self.rank:
                mine = local[lo - start : hi - start]
                if out is not None:
                    out[lo - rows[0] : hi - rows[0]].copy_(mine)
                else:
                    dist.send(mine.contiguous(), dst=0)
            elif out is not None:
                dist.recv(out[lo - rows[0] : hi - rows[0]], src=owner)
        return None if out is None else out.cpu()

    def peak_rss_mb(self) -> float:
        """This rank's peak resident memory (`asyncflow.observe.memory`)."""
        return peak_rss_mb()

    def loaded_peak_bytes(self) -> int:
        """The most bytes of whole (unsharded) tensors this rank held at once while loading the model (0: it loaded
        the whole model through `from_pretrained`, a critic's or teacher's run)."""
        return self.load_peak_bytes

    def full_gradients(self) -> dict[str, torch.Tensor] | None:
        """The accumulated gradients (before `step`), gathered whole to rank 0 (None elsewhere): for checks."""
        grads: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                grads[name] = grad.detach().cpu()
        return grads if self.rank == 0 else None

    def load_weights(self, state_dict: Mapping[str, torch.Tensor] | None) -> None:
        """Load a full state dict given to rank 0 (None elsewhere), broadcast into every rank's shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(
            self.model, dict(state_dict or {}),
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=self.critic is None),
        )

    def save_sharded(self, folder: str) -> None:
        """Every rank writes its shards of weights and optimizer state into `folder` (one `.distcp` each)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)

    def load_sharded(self, folder: str) -> None:
        """Load `folder` (written by any number of ranks) into this rank's shards, in place."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state: dict[str, Any] = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def scheduler_state(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_scheduler_state(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- launchers
class RankGroup(Protocol):
    """N ranks running `RankTrainer`s; `call` runs one method on every rank at once."""

    def call(self, method: str, args: Sequence[tuple[Any, ...]], timeout: float) -> list[Any]:
        """`getattr(rank_r, method)(*args[r])` on every rank r; -> the results in rank order. Raises
        `RankFailedError` when a rank dies, raises or does not answer within `timeout` seconds."""
        ...

    def close(self) -> None: ...


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


Launcher = Callable[[int, RankSpec, float], RankGroup]  # (world_size, spec, timeout) -> the started ranks


# ------------------------------------------------------------------------------------------- the driver
@register_train_engine("fsdp2", loads_policy=True)
@dataclass(eq=False)
class FSDP2TrainEngine(TrainEngineBase):
    """`TrainEngine` over `world_size` FSDP2 ranks (see the module docstring). The ranks load the weights from
    `model_path` through the normal loading code onto `ranks_device` ("cpu" or "cuda"); this process loads none.
    `model` is accepted for callers that hold a copy anyway: only its device is read, and no reference is kept.
    `launcher`: the runtime's `Launcher` that starts the ranks."""

    model: torch.nn.Module | None = None
    ranks_device: str | None = None
    model_path: str | Path | None = None
    world_size: int = 2
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = 1.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1
    use_reference: bool = False
    packing: Packing = "auto"
    dtype: str = "float32"
    launcher: Launcher | None = None
    timeout_s: float = 600.0
    threads_per_rank: int | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    precision: str = "fp32"
    activation_checkpointing: bool = False
    teacher_path: str | None = None  # a model folder each rank loads as the frozen teacher (`algo.teacher`)
    critic: CriticSpec | None = None
    router_aux_loss_coef: float | None = None
    router_replay: bool = False
    ranks: RankGroup = field(init=False, repr=False)
    _pipe: Any = field(default=None, init=False, repr=False)  # `_bucket_pipe`

    def __post_init__(self) -> None:
        if self.model_path is None:
            raise ValueError("train.engine=fsdp2 needs the model folder (model_path) for its ranks to load")
        if self.world_size < 1:
            raise ValueError(f"train.world_size must be >= 1, got {self.world_size}")
        if self.packing not in ("auto", "on", "off"):
            raise ValueError(f"packing must be 'auto', 'on' or 'off', got {self.packing!r}")
        check_precision(self.precision)
        if self.precision == "bf16" and self.dtype != "float32":
            raise ValueError(f"train.precision=bf16 keeps float32 master weights: set model.dtype=float32 "
                             f"(got {self.dtype})")
        device = torch.device(self.ranks_device) if self.ranks_device is not None else \
            next(self.model.parameters()).device if self.model is not None else torch.device("cpu")
        self.model = None  # the ranks hold the policy; the driver keeps no reference to its copy
        threads = self.threads_per_rank or max(1, torch.get_num_threads() // self.world_size)
        own: dict[str, Any] = {"model_path": str(self.model_path), "device": device.type, "betas": tuple(self.betas),
               "threads": threads}
        # every other field of the ranks' spec is this engine's field of the same name
        spec = RankSpec(**own, **{f.name: getattr(self, f.name) for f in fields(RankSpec) if f.name not in own})
        if self.launcher is None:
            raise ValueError("train.engine=fsdp2 needs a launcher for its ranks (a runtime's: "
                             "asyncflow.runtime.inline.ProcessRanks or the Ray runtime's)")
        self.ranks = self.launcher(self.world_size, spec, self.timeout_s)
        self._weights: dict[str, torch.Tensor] | None = None
        self.gather_peak_bytes = 0  # over the run: see `metrics`

    device = torch.device("cpu")  # where the trainer builds a micro-batch's loss tensors; ranks move them

    def _all(self, method: str, *args: Any) -> list[Any]:
        return self.ranks.call(method, [args] * self.world_size, self.timeout_s)

    def backward_micro_batch(
        self, samples: list[TrainSample], loss_fn: LossFn | RowLoss, *, temperature: float = 1.0
    ) -> dict[str, float]:
        """Each rank forwards and backpropagates its share of the rows (`assign_rows`); -> the summed stats."""
        if not hasattr(loss_fn, "select"):
            raise TypeError("train.engine=fsdp2 splits micro-batches over ranks: loss_fn must be a RowLoss "
                            "(with `select(rows)`), not a plain function")
        loss_fn = cast(RowLoss, loss_fn)
        shares = assign_rows(samples, self.world_size, keep_groups=self.packing != "off")
        args = [([samples[i] for i in rows], loss_fn.select(rows) if rows else None, temperature) for rows in shares]
        stats: dict[str, float] = {}
        for rank_stats in self.ranks.call("backward", args, self.timeout_s):
            for key, value in rank_stats.items():
                stats[key] = stats.get(key, 0.0) + value
        return stats

    def logprobs(self, samples: list[TrainSample], *, temperature: float = 1.0) -> torch.Tensor:
        """Policy log-probs `[N, L]` of `samples` without gradient (rows split over the ranks as in training)."""
        shares = assign_rows(samples, self.world_size, keep_groups=self.packing != "off")
        parts = self.ranks.call("logprobs", [([samples[i] for i in rows], temperature) for rows in shares],
                                self.timeout_s)
        width = max((len(s.response_ids) for s in samples), default=0)
        out = torch.zeros(len(samples), width)
        for rows, part in zip(shares, parts, strict=True):
            for k, i in enumerate(rows):
                out[i, : part.shape[1]] = part[k, :width]
        return out

    def optimizer_step(self, grad_scale: float = 1.0) -> dict[str, float]:
        self._weights = None
        stats: dict[str, float] = self._all("step", grad_scale)[0]
        return stats

    def weight_stream(self, distinct: bool = False, dtype: torch.dtype | None = None
                      ) -> Mapping[str, torch.Tensor] | BucketStream:
        """This version's full policy weights for a consumer that copies or forwards them bucket by bucket (a weight
        publisher, a checkpoint): streamed from the ranks one bucket at a time, each bucket one flat tensor cast on
        rank 0 to `dtype` where it is narrower (the receiving engine's), so no process holds them whole (rank 0 one
        bucket; this process the bucket in transit); the `state_dict` when it is already here. `distinct`: a tied
        embedding gathered and sent once, under its first name."""
        if self._weights is not None:
            return self._weights
        manifest: Manifest = self._all("weights_manifest", self.bucket_bytes, distinct, dtype)[0]
        pipe = self._bucket_pipe()

        def buckets() -> Iterator[list[torch.Tensor]]:
            for index, layout in enumerate(manifest.buckets):
                flat = torch.empty(layout.numel, dtype=layout.dtype)
                received = pipe.recv([flat], 0, 0)  # posted first: rank 0's send waits for it
                peaks = self._all("gathered_bucket", index)
                received.wait(timedelta(seconds=self.timeout_s))
                self.gather_peak_bytes = max(self.gather_peak_bytes, *peaks)
                del received
                yield [flat]
                del flat  # before the next bucket arrives: one bucket at a time here too

        return BucketStream(manifest, buckets)

    def _bucket_pipe(self) -> Any:
        """This process's end of the bucket pipe from rank 0 (opened at the first weight stream, kept until `close`):
        buckets arrive in a buffer of this process's own, freed once consumed, where a launcher's replies would
        come through Ray's object store, whose pages of every bucket that passed stay mapped in both processes (the
        driver's resident size grew by most of a version: docs/rehearsal.md)."""
        import torch.distributed as dist

        if self._pipe is None:
            host, port = self._all("open_pipe")[0]
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=self.timeout_s))
            self._pipe = make_group(store, 1, 2, "gloo", self.timeout_s)
        return self._pipe

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full policy weights in this process (for checkpoints, evaluation, a local inference engine), streamed
        from the ranks into one buffer once per version (cached until the next step or load). A publisher takes
        `weight_stream` instead, which builds no such copy."""
        if self._weights is None:
            stream = self.weight_stream()
            assert isinstance(stream, BucketStream)  # nothing cached
            payload = allocate_payload(stream.manifest)
            buckets = bucket_views(stream.manifest, payload)
            write_weights(stream, stream.manifest, buckets)
            self._weights = unpack(stream.manifest, buckets)
        return self._weights

    def metrics(self) -> dict[str, float]:
        """Per step: the most bytes of gathered (full) tensors any rank held at once while weights were gathered
        (`weights/gather_peak_bytes`, at most a bucket and one part of it), and each rank's peak resident memory."""
        out = {f"{MEMORY_METRIC_PREFIX}rank_{rank}": mb for rank, mb in enumerate(self._all("peak_rss_mb"))}
        if self.gather_peak_bytes:
            out["weights/gather_peak_bytes"] = float(self.gather_peak_bytes)
        return out

    def gradients(self) -> dict[str, torch.Tensor]:
        """The gradients accumulated since the last `optimizer_step`, whole (for checks and diagnostics)."""
        gradients: dict[str, torch.Tensor] = self._all("full_gradients")[0]
        return gradients

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self._weights = None
        args = [(dict(state_dict),)] + [(None,)] * (self.world_size - 1)
        self.ranks.call("load_weights", args, self.timeout_s)

    def training_state(self) -> dict[str, Any]:
        """The LR schedule (the optimizer state is in the sharded checkpoint: `save_sharded`)."""
        return {"engine": "fsdp2", "scheduler": self._all("scheduler_state")[0]}

    def load_training_state(self, state: dict[str, Any]) -> None:
        if state.get("engine") != "fsdp2":
            raise ValueError("this checkpoint was written by the single-process engine (its optimizer state is not "
                             "sharded): resume it with train.engine=torch")
        self._all("load_scheduler_state", state["scheduler"])

    def load_checkpoint(self, weights: Mapping[str, torch.Tensor], training_state: dict[str, Any]) -> None:
        """A checkpoint without a sharded folder: only one this engine wrote can resume here."""
        self.load_training_state(training_state)
        self.load_state_dict(weights)

    def save_sharded(self, folder: Path) -> None:
        """Weights and optimizer state of every rank into `folder` (torch.distributed.checkpoint)."""
        self._all("save_sharded", str(folder))

    def load_sharded(self, folder: Path) -> None:
        self._weights = None
        self._all("load_sharded", str(folder))

    def close(self) -> None:
        """Stop the ranks (idempotent)."""
        self._pipe = None
        if getattr(self, "ranks", None) is not None:
            self.ranks.close()
            del self.ranks  # closed: no group (a second close does nothing)
