"""Option parsing, in-process: CLI, YAML, precedence, and the errors."""

import pytest

from common.config import ConfigError
from train_extras.options import TrainConfig
from conftest import launch, parse_train


pytestmark = pytest.mark.quick  # launches nothing: docs/testing.md#running-the-tests


def test_defaults():
    cfg = parse_train([])
    assert cfg == TrainConfig()
    assert cfg.preset == "mini" and cfg.seq_len == 256 and cfg.data_files is None


def test_cli_types():
    cfg = parse_train(["--lr", "1e-4", "--max_steps", "7", "--warmup_steps", "0", "--gradient_checkpointing",
                       "--lr_schedule", "wsd",
                        "--save_model", "false"])
    assert cfg.lr == 1e-4 and cfg.max_steps == 7 and cfg.gradient_checkpointing == "true"  # the flag alone
    assert cfg.lr_schedule == "wsd" and cfg.save_model is False
    for value in ("true", "selective", "false"):
        assert parse_train(["--gradient_checkpointing", value]).gradient_checkpointing == value
    with pytest.raises(ConfigError, match="invalid choice: 'some'"):
        parse_train(["--gradient_checkpointing", "some"])
    with pytest.raises(ConfigError, match="--gradient_checkpointing some: choose true, selective or false"):
        TrainConfig(gradient_checkpointing="some")  # from code: the same check


def test_yaml_then_cli_precedence(tmp_path):
    data = tmp_path / "a.txt"
    data.write_text("hello\n")
    path = tmp_path / "run.yaml"
    path.write_text(f"lr: 1e-3\nmax_steps: 12\ngradient_checkpointing: true\ndata_files: [{data}, {data}]\n"
                    "model_name_or_path: null\n")
    cfg = parse_train(["--config", str(path), "--max_steps", "5", "--warmup_steps", "2"])
    assert cfg.lr == 1e-3  # YAML 1.1 reads 1e-3 as a string; the parser types it like the CLI does
    assert cfg.max_steps == 5  # the command line wins over the file
    assert cfg.gradient_checkpointing == "true"  # YAML's boolean, spelled as the CLI spells it
    assert cfg.data_files == [str(data), str(data)]


@pytest.mark.parametrize("argv, message", [
    (["--bogus", "1"], "unknown option(s) for train.py: --bogus 1"),
    (["--preset", "huge"], "unknown preset 'huge'"),
    (["--max_steps", "ten"], "invalid int value: 'ten'"),
    (["--lr_schedule", "exp"], "invalid choice: 'exp'"),
    (["--data_files", "/nonexistent/x.txt"], "data file not found: /nonexistent/x.txt"),
    (["--seq_len", "0"], "--seq_len must be positive"),
    (["--warmup_steps", "500", "--max_steps", "100"], "--warmup_steps must be in [0, max_steps=100]"),
    (["--config", "/nonexistent.yaml"], "config file not found"),
])
def test_bad_cli(argv, message):
    with pytest.raises(ConfigError) as err:
        parse_train(argv)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text, message", [
    ("lr: [1, 2\n", "bad YAML in"),
    ("- a\n- b\n", "expected a mapping"),
    ("bogus_key: 3\n", "unknown option 'bogus_key'"),
    ("preset: huge\n", "unknown preset 'huge'"),
    ("max_steps: [4, 5]\n", "bad.yaml: max_steps takes one value, got a list"),
    ("", "bad.yaml is empty"),
    ("# only comments\n\n# here\n", "bad.yaml is empty"),
])
def test_bad_yaml(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        parse_train(["--config", str(path)])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_help_lists_every_option(capsys):
    import dataclasses

    with pytest.raises(SystemExit) as exit_info:
        parse_train(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for f in dataclasses.fields(TrainConfig):
        assert f"--{f.name}" in text


def test_a_yaml_list_is_one_value_only_for_an_option_that_takes_several(tmp_path):
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    for f in files:
        f.write_text("hello\n")
    path = tmp_path / "run.yaml"
    path.write_text(f"data_files: [{files[0]}, {files[1]}]\nmax_steps: [4, 5]\n")
    with pytest.raises(ConfigError) as err:
        parse_train(["--config", str(path)])
    assert str(err.value) == f"{path}: max_steps takes one value, got a list"
    path.write_text(f"data_files: [{files[0]}, {files[1]}]\nmax_steps: 40\n")
    assert parse_train(["--config", str(path)]).data_files == [str(f) for f in files]
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing set yet\n")
    with pytest.raises(ConfigError) as err:
        parse_train(["--config", str(empty)])
    assert str(err.value) == f"config file {empty} is empty"


def test_option_errors_are_the_same_on_every_rank():
    """Every rank parses the same command line: one process per launcher prints the line."""
    with pytest.raises(ConfigError) as err:
        parse_train(["--bogus", "1"])
    assert err.value.every_rank


def test_each_config_runs_the_checks_it_lists_once_each_in_that_order(monkeypatch):
    """The order of the checks is written out (check_order), not implied by the order of the bases."""
    from common import config
    from conftest import ROOT, load_recipe

    recipes = sorted(p.stem for p in (ROOT / "recipes").glob("*.py") if p.stem not in ("train", "generate"))
    for options in [config.RecipeConfig, TrainConfig, *(load_recipe(name).Options for name in recipes)]:
        groups = [base for base in options.__mro__ if "check" in vars(base)]
        assert sorted(map(id, options.check_order)) == sorted(map(id, groups)), options  # each group once
    order = list(TrainConfig.check_order)
    ran = []

    def recorded(group):
        def check(self):
            ran.append(group.__name__)
            original(self)
        original = group.check
        return check

    for group in order:
        monkeypatch.setattr(group, "check", recorded(group))
    TrainConfig()
    assert ran == [group.__name__ for group in order]


def test_a_group_missing_from_check_order_or_listed_but_not_a_base_is_refused_at_class_creation():
    from dataclasses import dataclass

    from common import config

    with pytest.raises(TypeError, match="Forgot.check_order: Fp16Options is missing"):
        @dataclass
        class Forgot(config.Fp16Options, config.RecipeConfig):
            pass
    with pytest.raises(TypeError, match="NotABase.check_order: Fp16Options is not a base with a check"):
        @dataclass
        class NotABase(config.RecipeConfig):
            check_order = (*config.RecipeConfig.check_order, config.Fp16Options)
    with pytest.raises(TypeError, match="Twice.check_order: DataOptions is listed twice"):
        @dataclass
        class Twice(config.RecipeConfig):
            check_order = (*config.RecipeConfig.check_order, config.DataOptions)


@pytest.mark.quick
def test_a_flash_kernel_without_its_package_gpu_or_half_precision_is_one_line(monkeypatch):
    """train.py checks --attn_implementation flash_attention_2/3 before the model is built: transformers
    would fetch a kernel from the Hub for a missing package, and the kernel fails in fp32 at a forward."""
    import transformers.utils
    from types import SimpleNamespace

    from train_extras.attention import check_flash

    bf16, fp32 = SimpleNamespace(mixed_precision="bf16"), SimpleNamespace(mixed_precision="no")
    for kernel, package in (("flash_attention_2", "flash-attn"), ("flash_attention_3", "flash-attn-3")):
        with pytest.raises(ConfigError, match=f"needs a CUDA GPU and the {package} package installed"):
            check_flash(kernel, bf16)  # this machine: no CUDA, no flash-attn
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)  # as on a GPU node with it
    check_flash("flash_attention_2", bf16)
    with pytest.raises(ConfigError, match="runs in bf16 or fp16, and this launch's mixed precision is 'no'"):
        check_flash("flash_attention_2", fp32)
    for other in ("sdpa", "eager", "flex_attention"):
        check_flash(other, fp32)


def test_train_py_refuses_flash_attention_here_before_building_the_model(tmp_path, hf_home):
    proc = launch("train.py", ["--attn_implementation", "flash_attention_2", "--micro_batch_size", "1",
                               "--output_dir", str(tmp_path / "run")], hf_home, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and proc.stdout == ""  # before any work
    assert proc.stderr.startswith("error: --attn_implementation flash_attention_2 needs a CUDA GPU and the flash-attn "
                                  "package installed")
    assert not (tmp_path / "run" / "checkpoints").exists()
