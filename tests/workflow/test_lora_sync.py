"""LoRA weight versions through a run (issue 43): under `train.lora.sync: adapter` the replica's engine holds the base
and takes the adapter alone per version, through the weight channel (`async`) and directly (`sync`); `merged` sends
full weights as before."""

import pytest
from test_export import tiny_run

pytest.importorskip("peft")


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_each_version_reaches_the_rollout_engine_as_chosen(tmp_path, one_torch_thread, mode, sync):
    run = tiny_run(tmp_path / "run", "train.lora.rank=4", f"train.lora.sync={sync}", f"workflow.mode={mode}",
                   "checkpoint.every=0", "train.steps=3")
    engine = run.runtime.local_rollout.engine
    # `sync` takes every version; `async` (max_staleness 1) at least version 1 for step 2's partition. An engine
    # under adapter sync refuses full weights, one taking full weights refuses an adapter's.
    assert engine.weight_version == 3 if mode == "sync" else engine.weight_version >= 1
    assert (engine.adapter is not None) == (sync == "adapter")
    if sync == "adapter":
        held = {k: v for k, v in engine.adapter_weights().items() if ".lora_B." in k}
        trained = {k: v for k, v in run.train_engine.adapter_weights().items() if ".lora_B." in k}
        assert held.keys() == trained.keys()
        assert any(v.abs().sum() > 0 for v in held.values())  # B left zero would be the base alone
        if mode == "sync":
            assert all((held[k] == trained[k]).all() for k in held)
