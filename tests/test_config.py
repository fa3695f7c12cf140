import pytest

from asyncflow.config import ConfigError, dump_config, load_config


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
    ],
)
def test_bad_values_name_the_key(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert fragment in str(err.value)


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


def test_legacy_tis_cap_is_token_tis():
    """Configs written before `algo.mismatch_correction` (a run folder's config.yaml too) load unchanged."""
    algo = load_config(None, ["algo.tis_cap=3.0"]).algo
    assert (algo.mismatch_correction, algo.mismatch_threshold) == ("token_tis", 3.0)
    assert load_config(None, ["algo.tis_cap=null"]).algo.mismatch_correction == "off"
    with pytest.raises(ConfigError, match="algo.mismatch_threshold"):
        load_config(None, ["algo.mismatch_correction=geo_mis", "algo.mismatch_threshold=0.5"])

def test_world_size_needs_a_multi_rank_engine():
    with pytest.raises(ConfigError, match=r"train.world_size=2 needs a multi-rank engine \(train.engine=fsdp2\)"):
        load_config(None, ["train.world_size=2"])
    assert load_config(None, ["train.engine=fsdp2", "train.world_size=2"]).train.world_size == 2


def test_vllm_weight_transfer_is_a_checked_key():
    from asyncflow.config import build_config

    assert build_config({}, []).rollout.vllm_weight_transfer == "file"
    assert build_config({}, ["rollout.vllm_weight_transfer=collective"]).rollout.vllm_weight_transfer == "collective"
    with pytest.raises(ConfigError, match="vllm_weight_transfer"):
        build_config({}, ["rollout.vllm_weight_transfer=nccl"])


def test_each_policy_loss_reads_its_own_clip_keys(tmp_path):
    assert load_config(None, []).algo.clip_range() == (0.2, 0.28)  # ppo
    assert load_config(None, ["algo.loss=gspo"]).algo.clip_range() == (3e-4, 4e-4)
    assert load_config(None, ["algo.loss=cispo", "algo.cispo_clip_high=1.5"]).algo.clip_range() == (1.0, 1.5)
    config = load_config(None, ["algo.loss=gspo", "algo.gspo_clip_high=0.001"])
    dump_config(config, tmp_path / "config.yaml")  # every key written: the other losses' at their defaults
    assert load_config(tmp_path / "config.yaml") == config


@pytest.mark.parametrize("overrides, fragment", [
    (["algo.gspo_clip_low=0.01"], "algo.gspo_clip_low=0.01 applies to algo.loss=gspo only, but algo.loss is ppo"),
    (["algo.loss=gspo", "algo.cispo_clip_high=2"], "algo.cispo_clip_high=2.0 applies to algo.loss=cispo only"),
    (["algo.loss=cispo", "algo.clip_high=0.3"], "algo.clip_high=0.3 applies to algo.loss=ppo only"),
    (["algo.loss=gspo", "algo.gspo_clip_low=1"], "algo.gspo_clip_low: Input should be less than 1"),
    (["algo.loss=grpo"], "algo.loss: Input should be 'ppo', 'gspo' or 'cispo'"),
])  # fmt: skip
def test_a_clip_key_of_another_loss_is_refused(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert fragment in str(err.value)
