from pathlib import Path

import pytest

from asyncflow.config import MOVED_KEYS, ConfigError, build_config, dump_config, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 0.01\nrollout:\n  group_size: 4\n")
    config = load_config(path, ["train.lr=3e-4", "data.task=reverse", "rollout.stop_strings=null"][:2])
    assert config.train.lr == 3e-4
    assert config.rollout.group_size == 4
    assert config.data.task == "reverse"


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("train.lrr=1", "train.lrr: unknown key"),
        ("train.lr=-1", "train.lr: Input should be greater than 0"),
        ("train.steps=abc", "train.steps: Input should be a valid integer"),
        ("workflow.mode=fast", "workflow.mode: Input should be 'sync', 'stream' or 'async'"),
        ("nosection.key=1", "nosection: unknown key"),
        ("data.task=null", "data.task is null and data.path is not set"),
        ("train=3", "train: Input should be a valid dictionary"),
        ("weights.stage_on_driver=false", "weights.stage_on_driver: false needs runtime.kind: ray"),
    ],
)
def test_bad_values_name_the_key(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert fragment in str(err.value)


def test_versions_forwarded_from_the_ranks_are_never_sent_as_deltas():
    forwarded = ["weights.stage_on_driver=false", "runtime.kind=ray", "runtime.weight_sync=torch_distributed"]
    assert not load_config(None, forwarded).weights.stage_on_driver
    with pytest.raises(ConfigError, match="weights.stage_on_driver: false cannot send deltas"):
        load_config(None, [*forwarded, "weights.delta=true"])


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load_config(None, ["train.lr"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_resolved_config_round_trips(tmp_path):
    config = load_config(None, ["rollout.temperature=0.7", "algo.mismatch_correction=token_tis"])
    dump_config(config, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == config


def test_mismatch_corrections_combine_as_a_list_or_with_plus():
    assert load_config(None, ["algo.mismatch_correction=[token_tis]"]).algo.mismatch_correction == "token_tis"
    algo = load_config(None, ["algo.mismatch_correction=token_tis+seq_mask", "algo.mismatch.seq_mask_threshold=3"]).algo
    assert algo.mismatch_correction == ["token_tis", "seq_mask"] and algo.mismatch.seq_mask_threshold == 3
    assert algo.mismatch_corrections() == ["token_tis", "seq_mask"]
    assert load_config(None, []).algo.mismatch_corrections() == []


@pytest.mark.parametrize(("overrides", "error"), [
    (["algo.mismatch_correction=[token_tis, icepop]"], "both weight each token by its ratio"),
    (["algo.mismatch_correction=[off, m2po]"], "off cannot be combined"),
    (["algo.mismatch_correction=icepop", "algo.mismatch_threshold=3"], "algo.mismatch_threshold sets the one number"),
    (["algo.mismatch_correction=[token_tis, seq_mask]", "algo.mismatch_threshold=3"], "algo.mismatch_threshold sets"),
    (["algo.mismatch_correction=token_tis", "algo.mismatch_threshold=3", "algo.mismatch.token_tis_cap=4"],
     "set the same number"),
    (["algo.mismatch_correction=token_tis", "algo.mismatch.icepop_low=0.3"],
     "applies to algo.mismatch_correction=icepop"),
    (["algo.mismatch_correction=icepop", "algo.mismatch.icepop_low=2"], "icepop_low"),
])  # fmt: skip
def test_mismatch_keys_are_refused_where_they_do_not_apply(overrides, error):
    with pytest.raises(ConfigError, match=error):
        load_config(None, overrides)


def test_the_mismatch_threshold_is_checked_against_its_correction():
    with pytest.raises(ConfigError, match="algo.mismatch_threshold"):
        load_config(None, ["algo.mismatch_correction=geo_mis", "algo.mismatch_threshold=0.5"])


def test_world_size_needs_a_multi_rank_engine():
    with pytest.raises(ConfigError, match=r"train.world_size=2 needs a multi-rank engine \(train.engine=fsdp2\)"):
        load_config(None, ["train.world_size=2"])
    assert load_config(None, ["train.engine=fsdp2", "train.world_size=2"]).train.world_size == 2


def test_vllm_settings_are_a_section_of_the_vllm_engine():
    vllm = ["rollout.engine=vllm"]
    assert build_config({}, vllm).rollout.factory_options() == {"weight_transfer": "file",
                                                                 "gpu_memory_utilization": 0.4}
    options = build_config({}, [*vllm, "rollout.vllm.weight_transfer=collective", "rollout.vllm.kv_cache_gb=0.5",
                                "rollout.vllm.executor=uni", "rollout.engine_options={gpu_memory_utilization: 0.9}"]
                           ).rollout.factory_options()
    assert options == {"weight_transfer": "collective", "gpu_memory_utilization": 0.9, "kv_cache_memory_bytes": 2**29,
                       "distributed_executor_backend": "uni"}
    assert build_config({}, []).rollout.factory_options() == {}  # the torch engine takes none of them
    timed = build_config({}, [*vllm, "runtime.call_timeout_s=30", "runtime.start_timeout_s=90"])
    options = timed.rollout.factory_options(timed.runtime)  # vLLM's own waits end within the run's deadlines
    assert (options["call_timeout_s"], options["start_timeout_s"]) == (30, 90)
    with pytest.raises(ConfigError, match="weight_transfer"):
        build_config({}, [*vllm, "rollout.vllm.weight_transfer=nccl"])


def test_each_policy_loss_has_its_own_clip_range(tmp_path):
    def clip(*overrides):
        loss = load_config(None, list(overrides)).algo.loss
        return loss.kind, loss.clip_low, loss.clip_high

    assert clip() == ("ppo", 0.2, 0.28)
    assert clip("algo.loss=gspo") == ("gspo", 3e-4, 4e-4)
    assert clip("algo.loss=cispo", "algo.loss.clip_high=1.5") == ("cispo", 1.0, 1.5)
    assert clip("algo.loss.clip_high=0.3") == ("ppo", 0.2, 0.3)  # no kind given: the default loss
    assert build_config({"algo": {"loss": "gspo"}}, ["algo.loss.clip_high=0.001"]).algo.loss.clip_high == 0.001
    config = load_config(None, ["algo.loss=gspo", "algo.loss.clip_high=0.001"])
    dump_config(config, tmp_path / "config.yaml")  # written as {kind: gspo, clip_low: ..., clip_high: ...}
    assert load_config(tmp_path / "config.yaml") == config


@pytest.mark.parametrize("overrides, fragment", [
    (["algo.loss=gspo", "algo.loss.clip_low=1"], "algo.loss.gspo.clip_low: Input should be less than 1"),
    (["algo.loss=grpo"], "algo.loss: 'grpo' is not one of 'ppo', 'gspo', 'cispo'"),
    (["algo.loss.kind=cispo", "algo.loss.clip_lo=0.1"], "algo.loss.cispo.clip_lo: unknown key"),
    (["rollout.vllm.kv_cache_gb=1"], "rollout.vllm.kv_cache_gb applies to rollout.engine=vllm only"),
    (["algo.critic.value_coef=1"], "algo.critic.value_coef applies to algo.advantage=gae"),
])  # fmt: skip
def test_a_variants_keys_are_checked_against_it(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert fragment in str(err.value)


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_a_moved_key_is_refused_with_its_new_spelling(old):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{old}=1"])
    assert f"{old} has moved: write {MOVED_KEYS[old]}" in str(err.value)
    section, key = old.split(".")
    assert key not in type(getattr(load_config(None, []), section)).model_fields, "a moved key is not a field"


@pytest.mark.parametrize("entry, fragment", [
    ({"base_url": "http://127.0.0.1:1/v1", "model": "m"}, "reward.fns.0: a mapping here needs its `kind`"),
    ({"kind": "judgee", "base_url": "http://127.0.0.1:1/v1", "model": "m"}, "reward.fns.0: 'judgee' is not one of"),
])  # fmt: skip
def test_a_reward_entry_mapping_is_tagged_by_its_kind(entry, fragment):
    with pytest.raises(ConfigError) as err:
        build_config({"reward": {"fns": [entry]}})
    assert fragment in str(err.value)


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda path: path.name)
def test_every_example_config_loads(example):
    load_config(example)  # a key renamed in the schema but not in an example fails here, not in a user's first run
