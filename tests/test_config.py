"""The config layer: composition order, overrides, schema and cross-field checks, error messages."""

import glob
import os
import shutil
import subprocess
import sys

import pytest
import yaml

import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_FILES = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


@pytest.fixture
def configs(tmp_path):
    """A private copy of configs/ that a test may edit."""
    target = tmp_path / "configs"
    shutil.copytree(os.path.join(ROOT, "configs"), target)
    return target


def write_yaml(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(content, sort_keys=False) if not isinstance(content, str) else content)
    return str(path)


def problems_of(path, overrides=()):
    with pytest.raises(config.ConfigError) as excinfo:
        config.load(str(path), overrides)
    return excinfo.value.problems


def run_config_cli(*args):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "config.py"), *args], capture_output=True, text=True, cwd=ROOT
    )


def test_every_shipped_run_file_is_valid():
    assert RUN_FILES, "no run files in configs/"
    for path in RUN_FILES:
        resolved = config.load(path)
        assert set(resolved) == {"run_name", "hardware", "model", "train", "data"}, path


def test_a_run_s_saved_config_yaml_loads_as_a_run_file_and_takes_overrides(tmp_path):
    resolved = config.load(os.path.join(ROOT, "configs", "smoke-cpu.yaml"))
    saved = tmp_path / "config.yaml"
    saved.write_text(config.dump(resolved))
    assert config.load(str(saved)) == resolved
    assert config.load(str(saved), ["train.seed=7"])["train"]["seed"] == 7
    del resolved["data"]
    saved.write_text(config.dump(resolved))
    assert any("include" in problem for problem in problems_of(saved)), "not a saved config: needs include"


def test_the_run_file_overrides_its_layers_and_the_command_line_overrides_both(configs):
    base = yaml.safe_load((configs / "train" / "smoke.yaml").read_text())["train"]
    run = write_yaml(
        configs / "order.yaml",
        {
            "include": {
                "hardware": "hardware/cpu.yaml",
                "model": "model/smoke.yaml",
                "train": "train/smoke.yaml",
                "data": "data/smoke.yaml",
            },
            "run_name": "order",
            "train": {"seed": base["seed"] + 1, "max_steps": base["max_steps"] + 10},
        },
    )
    from_layers_and_run = config.load(run)
    assert from_layers_and_run["train"]["lr"] == base["lr"]  # from the layer
    assert from_layers_and_run["train"]["seed"] == base["seed"] + 1  # the run file beats the layer
    with_override = config.load(run, ["train.seed=99", "run_name=try-lr", "train.lr=3e-4"])
    assert with_override["train"]["seed"] == 99  # the command line beats the run file
    assert with_override["train"]["max_steps"] == base["max_steps"] + 10
    assert with_override["run_name"] == "try-lr"
    assert with_override["train"]["lr"] == pytest.approx(3e-4)


def test_a_layer_file_can_build_on_a_base_file_of_its_layer(configs):
    write_yaml(
        configs / "train" / "longer.yaml", {"include": "train/smoke.yaml", "train": {"max_steps": 900}}
    )
    run = configs / "smoke-cpu.yaml"
    content = yaml.safe_load(run.read_text())
    content["include"]["train"] = "train/longer.yaml"
    write_yaml(run, content)
    resolved = config.load(str(run))
    assert resolved["train"]["max_steps"] == 900
    assert (
        resolved["train"]["seed"]
        == yaml.safe_load((configs / "train/smoke.yaml").read_text())["train"]["seed"]
    )


def test_override_values_are_yaml_scalars():
    assert config.parse_override("train.seed=99") == (("train", "seed"), 99)
    assert config.parse_override("train.lr=3e-4") == (("train", "lr"), 3e-4)
    assert config.parse_override("hardware.compile=false") == (("hardware", "compile"), False)
    assert config.parse_override("run_name=try-lr") == (("run_name",), "try-lr")
    assert config.parse_override("train.sample_prompt=Había una vez") == (
        ("train", "sample_prompt"),
        "Había una vez",
    )


def test_an_override_without_equals_sign_is_rejected():
    with pytest.raises(config.ConfigError, match="expected section.key=value"):
        config.parse_override("train.seed")


def test_a_command_picks_out_its_layer_settings_by_the_one_override_syntax():
    argv = ["runs/x", "--port", "8000", "--config=configs/serve/x.yaml", "serve.queue_size=4",
            "memory.snapshots.every_hours=6", "run_name=try", "serve.=4", "serve", "serve.max_batch"]  # fmt: skip
    assert [w for w in argv if config.is_override(w, "serve")] == ["serve.queue_size=4"]
    assert [w for w in argv if config.is_override(w, "memory")] == ["memory.snapshots.every_hours=6"]
    overrides = [w for w in argv if config.is_override(w)]
    assert overrides == ["serve.queue_size=4", "memory.snapshots.every_hours=6", "run_name=try"]
    for word in argv:  # a word is picked out exactly when parse_override reads it
        if word in overrides:
            config.parse_override(word)
        else:
            with pytest.raises(config.ConfigError, match="expected section.key=value"):
                config.parse_override(word)


def test_unknown_key_on_the_command_line_suggests_the_closest_key_and_exits_2():
    result = run_config_cli("configs/smoke-cpu.yaml", "train.sede=1")
    assert result.returncode == 2
    assert "train.sede: unknown key; did you mean train.seed?" in result.stderr
    assert "command line (train.sede=1)" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_key_in_a_layer_file_names_that_file(configs):
    layer = configs / "train" / "smoke.yaml"
    content = yaml.safe_load(layer.read_text())
    content["train"]["run_nombre"] = "x"
    write_yaml(layer, content)
    (problem,) = problems_of(configs / "smoke-cpu.yaml")
    assert problem == f"{layer}: train.run_nombre: unknown key; did you mean train.runs_dir?"


def test_every_problem_is_reported_at_once_with_file_key_value_and_what_is_allowed(configs):
    problems = problems_of(
        configs / "smoke-cpu.yaml",
        ["train.seed=-1", "hardware.dtype=float8", "train.decay_shape=cosine", "train.lr=fast"],
    )
    assert len(problems) == 4, problems
    text = "\n".join(problems)
    assert "command line (train.seed=-1): train.seed: -1 is out of range; expected >= 0" in text
    assert "hardware.dtype: 'float8' is not allowed; allowed: 'float32', 'float16', 'bfloat16'" in text
    assert "train.decay_shape: 'cosine' is not allowed; allowed: 'linear', '1-sqrt'" in text
    assert "train.lr: 'fast' has the wrong type; expected number" in text


def test_a_missing_required_key_names_the_layer_file_and_the_key(configs):
    layer = configs / "train" / "smoke.yaml"
    content = yaml.safe_load(layer.read_text())
    del content["train"]["keep_last"]
    write_yaml(layer, content)
    (problem,) = problems_of(configs / "smoke-cpu.yaml")
    assert problem.startswith(f"{layer}: train.keep_last: required key missing")


def test_a_number_written_without_a_dot_gets_a_hint(configs):
    layer = configs / "train" / "smoke.yaml"
    layer.write_text(layer.read_text().replace("lr: 3.0e-3", "lr: 3e-3"))
    (problem,) = problems_of(configs / "smoke-cpu.yaml")
    assert "train.lr: '3e-3' has the wrong type" in problem and "write it with a dot, e.g. 0.003" in problem


def test_a_missing_include_file_is_named_with_the_file_that_included_it(configs):
    run = configs / "smoke-cpu.yaml"
    run.write_text(run.read_text().replace("model/smoke.yaml", "model/nope.yaml"))
    (problem,) = problems_of(run)
    assert problem == f"{configs / 'model' / 'nope.yaml'}: file not found (included from {run})"


def test_a_yaml_syntax_error_names_the_file_and_line(configs):
    layer = configs / "train" / "smoke.yaml"
    layer.write_text(layer.read_text() + "  broken: [unclosed\n")
    (problem,) = problems_of(configs / "smoke-cpu.yaml")
    assert problem.startswith(f"{layer}: YAML syntax error at line")


def test_an_include_cycle_is_reported_as_such(configs):
    write_yaml(configs / "train" / "a.yaml", {"include": "train/b.yaml", "train": {}})
    write_yaml(configs / "train" / "b.yaml", {"include": "train/a.yaml", "train": {}})
    run = configs / "smoke-cpu.yaml"
    content = yaml.safe_load(run.read_text())
    content["include"]["train"] = "train/a.yaml"
    write_yaml(run, content)
    (problem,) = problems_of(run)
    assert "include cycle:" in problem and "a.yaml -> " in problem and "b.yaml -> " in problem


def test_a_run_file_must_name_every_layer(configs):
    run = configs / "smoke-cpu.yaml"
    content = yaml.safe_load(run.read_text())
    del content["include"]["data"]
    content["include"]["modle"] = "model/smoke.yaml"
    write_yaml(run, content)
    problems = problems_of(run)
    assert f"{run}: include.data: missing; name the data layer file" in problems
    assert f"{run}: include.modle: unknown layer; did you mean include.model?" in problems


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["model.n_heads=5"], "model.d_model: 256 must be divisible by model.n_heads=5"),
        (["model.n_kv_heads=3"], "model.n_kv_heads: 3 must divide model.n_heads=4"),
        (["model.d_model=36", "model.n_heads=4", "model.n_kv_heads=2"], "head_dim = d_model/n_heads = 9"),
        (
            ["train.max_steps=300", "train.warmup_steps=250", "train.decay_fraction=0.3"],
            "exceed train.max_steps=300",
        ),
        (["hardware.grad_scaler=true"], "hardware.grad_scaler: true, but only float16 uses it"),
        (["model.vocab_size=512"], "model.vocab_size: 512 but data.format is bytes; expected 256"),
    ],
)
def test_cross_field_rules_name_the_key_and_the_rule(overrides, expected):
    smoke = os.path.join(ROOT, "configs", "smoke-cpu.yaml")
    base_model = config.load(smoke)["model"]
    assert (base_model["d_model"], base_model["n_heads"]) == (256, 4), "fixture assumes the smoke shape"
    problems = problems_of(smoke, overrides)
    assert any(expected in p for p in problems), problems


def test_float16_without_a_grad_scaler_is_refused():
    problems = problems_of(os.path.join(ROOT, "configs", "smoke-2060.yaml"), ["hardware.grad_scaler=false"])
    assert any("float16 needs a GradScaler" in p for p in problems), problems


def test_vocab_larger_than_uint16_is_refused_for_shards():
    problems = problems_of(os.path.join(ROOT, "configs", "pretrain-2060.yaml"), ["model.vocab_size=70000"])
    assert any("does not fit the uint16 shards" in p for p in problems), problems


def test_print_shows_the_resolved_config_as_yaml():
    result = run_config_cli("configs/smoke-cpu.yaml", "train.seed=7", "--print")
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["train"]["seed"] == 7 and resolved["run_name"] == "smoke-cpu"
    assert list(resolved) == ["config_format", "run_name", "hardware", "model", "train", "data"]


def test_config_stays_free_of_torch_while_validating_every_config():
    code = (
        "import sys, config\n"
        "assert config.check_all('configs') == 0\n"
        "assert 'torch' not in sys.modules, 'config imported torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_yamllint_ignores_are_anchored_so_a_broken_file_under_configs_data_fails_lint(tmp_path):
    # A copy of the linted tree plus one broken YAML file under configs/data/ (what `data/` unanchored hid).
    copy = tmp_path / "repo"
    top_level_skips = {".venv", ".git", "runs", "data", ".pytest_cache", ".ruff_cache"}
    shutil.copytree(
        ROOT, copy, ignore=lambda folder, names: top_level_skips & set(names) if folder == ROOT else []
    )
    (copy / "configs" / "data" / "broken.yaml").write_text("data:\n  format: [unclosed\n")
    (copy / "data").mkdir()
    (copy / "data" / "generated.yaml").write_text("not: [linted\n")  # really ignored: /data/ at the root
    yamllint = os.path.join(os.path.dirname(sys.executable), "yamllint")
    result = subprocess.run([yamllint, "--strict", "."], capture_output=True, text=True, cwd=copy)
    assert result.returncode != 0
    assert "configs/data/broken.yaml" in result.stdout
    assert "data/generated.yaml" not in result.stdout.replace("configs/data/", "")
    make_lint = subprocess.run(
        ["make", "lint", f"VENV={os.path.dirname(os.path.dirname(sys.executable))}"],
        capture_output=True,
        text=True,
        cwd=copy,
    )
    assert make_lint.returncode != 0
    assert "configs/data/broken.yaml" in make_lint.stdout + make_lint.stderr


def test_a_config_yaml_of_a_shards_run_written_before_this_rounds_keys_loads_as_its_run_trained(tmp_path):
    # Release 2026-12-02 wrote no config_format and knew none of the keys this round made required.
    saved = config.load(os.path.join(ROOT, "configs", "smoke-corpus-cpu.yaml"))
    new_keys = [("train", "space_check"), ("train", "optimizer"), ("train", "muon"), ("model", "zero_init_out_proj"),
                ("hardware", "muon_ns_dtype"), ("data", "packing")]  # fmt: skip
    for section, key in new_keys:
        saved[section].pop(key, None)
    saved["data"]["corpus"].pop("download")
    (tmp_path / "config.yaml").write_text(config.dump(saved).replace("config_format: 1\n", ""))
    loaded = config.load(str(tmp_path / "config.yaml"))
    assert (loaded["train"]["optimizer"], loaded["train"]["space_check"]) == ("adamw", "refuse")
    assert loaded["model"]["zero_init_out_proj"] is False and loaded["hardware"]["muon_ns_dtype"] == "float32"
    assert loaded["data"]["packing"] == "windows" and loaded["data"]["corpus"]["download"] == {"workers": 4}
