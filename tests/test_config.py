"""Config loading: presets validate; bad files give one clear error line naming the file and the key."""

import subprocess
import sys

import pytest

from dflash_app.config import load_config, preset_names, resolve_config, resolve_config_path
from dflash_core.config import ConfigError, PipelineConfig, parse_config
from dflash_core.model.drafter import default_target_layer_ids


def _write(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


MINIMAL = "data: {source: d.jsonl, tokenizer: tok}\nmodel: {target: t}\n"


@pytest.mark.parametrize("preset", ["tiny-cpu", "qwen3-8b-8gpu"])
def test_presets_load(preset):
    cfg = load_config(preset)
    assert isinstance(cfg, PipelineConfig)


def test_qwen3_preset_has_the_public_recipe():
    cfg = load_config("qwen3-8b-8gpu")
    assert (cfg.model.block_size, cfg.model.num_draft_layers, cfg.data.max_length) == (16, 5, 3072)
    assert (cfg.train.lr, cfg.train.warmup_ratio, cfg.train.clip_grad, cfg.train.schedule) == (6e-4, 0.04, 1.0, "cosine")
    # the recipe's spread comes from the target's depth, so a copy of the preset fits another target
    assert cfg.model.target_layer_ids is None
    assert default_target_layer_ids(36, cfg.model.num_draft_layers) == [1, 9, 17, 25, 33]
    assert cfg.plan.world_size == 8


def test_minimal_config_fills_defaults(tmp_path):
    cfg = load_config(_write(tmp_path, MINIMAL))
    assert cfg.plan.num_buckets == 6 and cfg.wandb.mode == "offline"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (MINIMAL + "plan: {max_tokens: lots}\n", "key 'plan.max_tokens'"),
        (MINIMAL + "train: {learning_rate: 0.1}\n", "unknown key 'train.learning_rate'"),
        (MINIMAL + "extra_section: {}\n", "unknown key 'extra_section'"),
        # an unknown key names the key the user most likely meant
        (MINIMAL + "train: {lrr: 0.1}\n", "unknown key 'train.lrr' (did you mean 'train.lr'?)"),
        (MINIMAL + "train: {block_size: 8}\n", "unknown key 'train.block_size' (did you mean 'model.block_size'?)"),
        ("data: {source: d, tokenizer: t, regenerate: {max_token: 9}}\nmodel: {target: t}\n",
         "unknown key 'data.regenerate.max_token' (did you mean 'data.regenerate.max_tokens'?)"),
        ("model: {target: t}\n", "missing key 'data'"),
        (MINIMAL + "plan: {buckets: [512, 256]}\n", "key 'plan.buckets'"),
        (MINIMAL + "plan: [1, 2\n", "invalid YAML: line"),
        # YAML's infinity and NaN are no setting (an infinite temperature passed its ge=0 bound)
        ("data: {source: d, tokenizer: t, regenerate: {temperature: .inf}}\nmodel: {target: t}\n",
         "key 'data.regenerate.temperature': Input should be a finite number"),
        (MINIMAL + "train: {lr: .nan}\n", "key 'train.lr': Input should be a finite number"),
        ("- a\n- b\n", "must be a mapping"),
    ],
)
def test_bad_config_is_one_clear_error(tmp_path, text, expected):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert expected in message and path in message and "\n" not in message


def test_missing_file_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(str(tmp_path / "nope.yaml"))


def test_overrides_are_validated(tmp_path):
    path = _write(tmp_path, MINIMAL)
    assert load_config(path, {"train.lr": 0.01}).train.lr == 0.01
    with pytest.raises(ConfigError, match="train.lr"):
        load_config(path, {"train.lr": -1})


def test_parse_config_round_trips_through_json():
    cfg = load_config("tiny-cpu")
    assert parse_config(cfg.model_dump(mode="json")) == cfg


def test_cli_bad_config_exits_2_with_one_line(tmp_path):
    path = _write(tmp_path, MINIMAL + "plan: {max_tokens: -3}\n")
    proc = subprocess.run([sys.executable, "-m", "dflash_app.cli", "plan", "--tokenized", str(tmp_path),
                           "--out", str(tmp_path / "p"), "--config", path], capture_output=True, text=True)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "plan.max_tokens" in lines[0] and path in lines[0]


def test_cli_help_lists_the_stages():
    proc = subprocess.run([sys.executable, "-m", "dflash_app.cli", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for stage in ("example", "tokenize", "plan", "train", "check", "eval", "run", "demo"):
        assert stage in proc.stdout


def test_presets_ship_with_the_app_and_paths_pass_through(tmp_path):
    assert {"tiny-cpu", "qwen3-8b-8gpu"} <= set(preset_names())
    assert resolve_config_path("tiny-cpu").endswith("dflash_app/presets/tiny-cpu.yaml")
    path = _write(tmp_path, MINIMAL)
    assert resolve_config_path(path) == path and resolve_config_path("s3://b/c.yaml") == "s3://b/c.yaml"
    with pytest.raises(ConfigError, match="no-such-preset: no such config file"):
        load_config("no-such-preset")


def test_example_uris_are_resolved_once_by_the_app(example_assets):
    cfg = load_config("tiny-cpu")
    assert cfg.data.source == "example://data"  # loading keeps the URIs; the launchers resolve them
    resolved = resolve_config(cfg)
    assert (resolved.data.source, resolved.data.tokenizer, resolved.model.target) == (
        example_assets.data, example_assets.tokenizer, example_assets.target)
    assert resolved.plan == cfg.plan and resolved.train == cfg.train


def test_bad_overrides_and_files_are_named_precisely(tmp_path):
    with pytest.raises(ConfigError, match=r"--set data.source.x: 'data.source' is a value"):
        load_config("tiny-cpu", {"data.source.x": 1})
    with pytest.raises(ConfigError, match=r"^--set train.lr \(over .*tiny-cpu.yaml\): key 'train.lr'"):
        load_config("tiny-cpu", {"train.lr": "abc"})
    # an unknown section or key given by --set is --set's fault too, and a union's member tags are no keys
    with pytest.raises(ConfigError, match=r"^--set trian.lr \(over .*tiny-cpu.yaml\): unknown key 'trian' \(did you mean 'train'\?\)$"):
        load_config("tiny-cpu", {"trian.lr": 1e-3})
    with pytest.raises(ConfigError, match=r"^--set plan.buckets \(over .*\): key 'plan.buckets': Input should be "
                                          r"'auto' or Input should be a valid list \(got 'foo'\)$"):
        load_config("tiny-cpu", {"plan.buckets": "foo"})
    # a command's own flag is blamed by its name
    with pytest.raises(ConfigError, match=r"^--buckets \(over .*\): key 'plan.buckets': buckets must be"):
        load_config("tiny-cpu", {"plan.buckets": [512, 128]}, {"plan.buckets": "--buckets"})
    twice = tmp_path / "twice.yaml"
    twice.write_text("data:\n  source: a\ntrain:\n  lr: 1\ntrain:\n  lr: 2\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: invalid YAML: line 5, .*duplicate key 'train' \(first on line 3\)"):
        load_config(str(twice))
    with pytest.raises(ConfigError, match="is a folder; --config takes a YAML file"):
        load_config(str(tmp_path))


def test_cli_rejects_a_bad_set_value_and_zero_processes(tmp_path):
    for args, culprit in ((["--set", "train.lr=[1"], "--set train.lr"), (["--nproc-per-node", "0"], "--nproc-per-node")):
        proc = subprocess.run([sys.executable, "-m", "dflash_app.cli", "train", "--tokenized", str(tmp_path),
                               "--plan", str(tmp_path), "--out", str(tmp_path / "o"), *args],
                              capture_output=True, text=True)
        assert proc.returncode == 2 and culprit in proc.stderr and "Traceback" not in proc.stderr
