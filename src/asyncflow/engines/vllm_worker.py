"""The part of the vLLM adapter that runs inside vLLM's worker process (a worker extension).

Owns: `WeightSyncExtension`, which vLLM mixes into its worker class when the engine is started with
`worker_extension_cls="asyncflow.engines.vllm_worker.WeightSyncExtension"`; the adapter
(`asyncflow.engines.vllm_engine`) calls its methods by name through `collective_rpc`.

Invariants:
- Importing this module imports neither vLLM nor anything that needs it: the worker already has vLLM
  loaded, and the parent process never imports this module.
- New weights arrive as a path to one safetensors file with Hugging Face parameter names (tensors passed
  through `collective_rpc` would reach the worker as plain lists); they are loaded through the worker's
  own `reload_weights`, which restores the layers that vLLM's CPU backend repacked into kernel formats,
  loads the tensors and repacks them. `model.load_weights` would fail on those repacked layers.
"""

from __future__ import annotations

from typing import Iterator

import torch


class WeightSyncExtension:
    """Methods mixed into vLLM's worker (`self` is the worker: it has `reload_weights` and `model_runner`)."""

    def asyncflow_load_weights(self, path: str) -> int:
        """Load every tensor of the safetensors file `path` into the model in place; returns how many."""
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            names = list(f.keys())

            def tensors() -> Iterator[tuple[str, torch.Tensor]]:
                for name in names:
                    yield name, f.get_tensor(name)

            self.reload_weights(weights_iterator=tensors())
        return len(names)

    def asyncflow_pretruncation_logprobs(self) -> bool:
        """Make the sampler report log softmax(logits / T) *before* top-k/top-p truncation (the definition of
        `Completion.logprobs`); vLLM's `processed_logprobs` mode takes them after truncation. Returns False when
        this vLLM's sampler is not laid out as expected (the adapter then refuses top-k/top-p)."""
        sampler = getattr(getattr(self, "model_runner", None), "sampler", None)
        top_k_top_p = getattr(sampler, "topk_topp_sampler", None)
        truncating_sample = getattr(top_k_top_p, "forward", None)
        if truncating_sample is None or getattr(sampler, "logprobs_mode", None) != "processed_logprobs":
            return False
        if getattr(truncating_sample, "asyncflow_pretruncation", False):
            return True

        # Called with temperature-scaled logits [n, V]; it may truncate them in place, so take the log-softmax first.
        def sample(logits: torch.Tensor, generators, k, p):
            if k is None and p is None:  # nothing truncated: vLLM's own log-probs are already these
                return truncating_sample(logits, generators, k, p)
            logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
            tokens, _ = truncating_sample(logits, generators, k, p)
            return tokens, logprobs

        sample.asyncflow_pretruncation = True
        top_k_top_p.forward = sample
        return True
