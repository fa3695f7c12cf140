"""LoRA weight versions through a run (issue 43): under `train.lora.sync: adapter` the replica's engine holds the base
and takes the adapter alone per version, through the weight channel (`async`) and directly (`sync`); `merged` sends
full weights as before."""

import pytest
from test_export import tiny_run

pytest.importorskip("peft")


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("sync", ["adapter", "merged"])
@pytest.mark.slow
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


@pytest.mark.ray
@pytest.mark.slow
def test_adapter_sync_on_ray_samples_what_the_trainer_computes(tmp_path, ray_cluster):
    """A Ray replica under adapter sync takes each version as the adapter alone (a few percent of the model's bytes)
    and its sampling log-probs equal the trainer's on the tokens of the version the trainer holds."""
    import math

    from test_weight_updates import config, model_bytes, rows

    from asyncflow.api import train

    history = rows(train(config(
        tmp_path, "workflow.mode=stream", "runtime.kind=ray", "runtime.lend_idle_cores=false", "train.steps=3",
        "train.lora.rank=4", "train.lora.sync=adapter", "train.lr=1e-2",
    )).history)
    assert len(history) == 3
    taken = [h for h in history if not math.isnan(h["weights/update_bytes"])]
    assert taken and all(0 < h["weights/update_bytes"] < 0.1 * model_bytes(4) for h in taken)
    adapted = [h for h in history if h["weights/update_version"] >= 1]  # B != 0: the adapter changes the outputs
    gaps = [h["mismatch/abs_log_ratio_same_version"] for h in adapted]
    assert gaps and all(g < 1e-4 for g in gaps), gaps
