"""The rehearsal at CI size (docs/rehearsal.md): `scripts/rehearsal.py` on a 2-layer model of Qwen2.5's family
(`qwen2.5-tiny-2l`: grouped-query attention, tied embeddings, the byte-level BPE tokenizer and ChatML template)
with the engines and runtime of `examples/rehearsal_0.5b.yaml`: vLLM rollouts in bf16, FSDP2 with 2 ranks in
bf16 with activation checkpointing and a token budget, `async` k=1 on three `ray start` nodes, weights by the
collective path (gloo to the replica's node, then into vLLM). The run is killed with SIGKILL after its first
checkpoint and `--resume` finishes it: every prompt trained exactly once; its export loads back through
`AutoTokenizer` / `AutoModelForCausalLM` with the last checkpoint's weights (the script's checks)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Two runs, each starting two FSDP2 rank actors and a vLLM engine (side by side) on three Ray nodes: 78 s on an idle
# 2-core machine, 837 s at load 8-24 (docs/rehearsal.md); the timeout leaves room for a loaded one
pytestmark = [pytest.mark.vllm, pytest.mark.rehearsal, pytest.mark.slow, pytest.mark.long, pytest.mark.ray,
              pytest.mark.timeout(1800)]
pytest.importorskip("vllm", reason="needs vLLM: bash scripts/test_vllm.sh")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from rehearsal import EXAMPLE, rehearse  # noqa: E402

CI_SIZE = ["model.path=preset:qwen2.5-tiny-2l", "train.steps=3", "rollout.prompts_per_step=2",
           "rollout.group_size=2", "rollout.max_new_tokens=8", "rollout.vllm.kv_cache_gb=0.25",
           "train.max_tokens_per_micro_batch=64", "runtime.call_timeout_s=300"]


def test_killed_rehearsal_resumes_exactly_once_and_exports(tmp_path):
    summary = rehearse(EXAMPLE, CI_SIZE, tmp_path, kill_after=1)
    assert summary["steps"] == 3
    assert {"driver", "rank_0", "rank_1", "rollout_0"} <= set(summary["peak_rss_mb"]), summary
