"""The part of the vLLM adapter that runs inside vLLM's worker process (a worker extension).

Owns: `WeightSyncExtension`, which vLLM mixes into its worker class when the engine is started with
`worker_extension_cls="asyncflow.engines.vllm_worker.WeightSyncExtension"`; the adapter
(`asyncflow.engines.vllm_engine`) calls its methods by name through `collective_rpc`.

Invariants:
- Importing this module imports neither vLLM nor anything that needs it: the worker already has vLLM
  loaded, and the parent process never imports this module.
- New weights (Hugging Face parameter names) arrive one of two ways, never as tensors passed through
  `collective_rpc` (they would reach the worker as plain lists): `asyncflow_receive_weights` takes them as
  buckets broadcast by the adapter's process over the weight group that `asyncflow_join_weight_group` made
  (`asyncflow.weights.collective`: gloo on CPU, NCCL on CUDA; only the manifest travels through the RPC);
  `asyncflow_load_weights` reads them from one safetensors file (the fallback).
- Both load through the worker's own `reload_weights`, which restores the layers that vLLM's CPU backend
  repacked into kernel formats, loads the tensors and repacks them (`model.load_weights` would fail on those
  repacked layers); the collective path feeds it each bucket's tensors as the bucket arrives (a tensor split
  over buckets whole, after its last slice: `CollectiveGroup.receive`).
- Every bucket announced is received even when loading fails part-way, so the sender is never left waiting;
  a failure then raises here, and `collective_rpc` hands it to the adapter.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from asyncflow.weights.collective import CollectiveGroup, join_group


class WeightSyncExtension:
    """Methods mixed into vLLM's worker (`self` is the worker: it has `reload_weights` and `model_runner`)."""

    if TYPE_CHECKING:  # what vLLM's worker brings (never defined here: they would shadow the worker's own)
        rank: int

        def reload_weights(self, *, weights_iterator: Iterator[tuple[str, torch.Tensor]]) -> None: ...

    def asyncflow_load_weights(self, path: str) -> int:
        """Load every tensor of the safetensors file `path` into the model in place; returns how many."""
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
            self.reload_weights(weights_iterator=((name, f.get_tensor(name)) for name in names))
        return len(names)

    def asyncflow_join_weight_group(self, host: str, port: int, world_size: int, timeout_s: float) -> int:
        """Join the adapter's weight group (store at `host:port`) as rank 1 + this worker's rank; returns that rank.
        A group this worker had already is closed first (the adapter makes a new one after a failure)."""
        old: CollectiveGroup | None = getattr(self, "_asyncflow_weight_group", None)
        if old is not None:
            old.close()
        rank = 1 + self.rank
        device = getattr(self, "device", None) or torch.device("cpu")
        self._asyncflow_weight_group = join_group(
            host, port, rank, world_size, device=device, timeout_s=timeout_s, side=f"vLLM worker {self.rank}"
        )
        return rank

    def asyncflow_receive_weights(self, manifest: bytes, version: int) -> int:
        """Receive version `version` (laid out as the pickled `Manifest`) over the weight group and load it in
        place, each bucket as it arrives; returns how many tensors were loaded."""
        group: CollectiveGroup | None = getattr(self, "_asyncflow_weight_group", None)
        if group is None:
            raise RuntimeError(f"vLLM worker {self.rank} has no weight group (asyncflow_join_weight_group first)")
        incoming = group.receive(pickle.loads(manifest), version)
        loaded = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal loaded
            for item in incoming:
                loaded += 1
                yield item

        try:
            self.reload_weights(weights_iterator=counted())
        finally:
            for _ in incoming:  # whatever reload_weights did not ask for: the sender is still broadcasting it
                pass
        return loaded

    def asyncflow_lora_modules(self) -> list[str] | None:
        """The module names (last component, as peft names them: `q_proj`, not vLLM's packed `qkv_proj`) that vLLM's
        LoRA takes on this model, as its adapter loader expects them; None when LoRA is off or the loader is not
        laid out as expected."""
        manager = getattr(getattr(getattr(self, "model_runner", None), "lora_manager", None), "_adapter_manager", None)
        supported = getattr(manager, "supported_lora_modules", None)
        packed = getattr(manager, "packed_modules_mapping", None)
        if supported is None or packed is None:
            return None
        return sorted({name for module in supported for name in packed.get(module, [module])})

    def asyncflow_pretruncation_logprobs(self) -> bool:
        """Make the sampler report log softmax(logits / T) *before* top-k/top-p truncation (the definition of
        `Completion.logprobs`); vLLM's `processed_logprobs` mode takes them after truncation. Returns False when
        this vLLM's sampler is not laid out as expected (the adapter then refuses top-k/top-p)."""
        sampler = getattr(getattr(self, "model_runner", None), "sampler", None)
        top_k_top_p = getattr(sampler, "topk_topp_sampler", None)
        truncating_sample = getattr(top_k_top_p, "forward", None)
        processed = getattr(sampler, "logprobs_mode", None) == "processed_logprobs"
        if top_k_top_p is None or truncating_sample is None or not processed:
            return False
        if getattr(truncating_sample, "asyncflow_pretruncation", False):
            return True

        # Called with temperature-scaled logits [n, V]; it may truncate them in place, so take the log-softmax first.
        def sample(logits: torch.Tensor, generators: Any, k: Any, p: Any) -> Any:
            if k is None and p is None:  # nothing truncated: vLLM's own log-probs are already these
                return truncating_sample(logits, generators, k, p)
            logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
            tokens, _ = truncating_sample(logits, generators, k, p)
            return tokens, logprobs

        sample.asyncflow_pretruncation = True  # type: ignore[attr-defined]  # a marker on the function object
        top_k_top_p.forward = sample
        return True
