"""Every documented launch line runs: the README's, every accelerate_configs/ and configs/ header's,
every recipe docstring's (tests/documented.py finds them and makes their CPU form: only what a
CPU machine needs changed). Each distinct CPU form is launched once, in a fresh folder holding the
repository's files, so relative paths in the line (configs/, outputs/) mean what they say; the
lines of configs/ run in one folder, in order (the fine-tuning line starts from the pretraining
line's export). A documented line that no test ran cannot exist: a new one is launched here."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess

import pytest
from accelerate.utils import set_seed

from common.data import build_tokenizer
from common.model import build_model
from conftest import ACCELERATE, ROOT, launch_env, warm_or_cold, warm_workers_env
from documented import CpuCommand, distinct_cpu_commands, documented_lines, expected_precision
from synthetic import CHAT_TEMPLATE, conversations_file
from train_extras.options import TrainConfig

STEPS = ["--max_steps", "2", "--warmup_steps", "1"]
COMMANDS = distinct_cpu_commands(STEPS)
# What accelerate runs under each config on CPU (the harness turns GPU strategies into themselves).
DISTRIBUTED_TYPE = {"ddp.yaml": "MULTI_CPU", "multi_node_ddp.yaml": "MULTI_CPU", "fsdp.yaml": "FSDP",
                    "fsdp_offload.yaml": "FSDP", "fsdp_shard_grad_op.yaml": "FSDP", "multi_node_fsdp.yaml": "FSDP",
                    "multi_node_hsdp.yaml": "FSDP", "deepspeed_zero1.yaml": "DEEPSPEED",
                    "deepspeed_zero2.yaml": "DEEPSPEED", "deepspeed_zero3.yaml": "DEEPSPEED",
                    "deepspeed_zero3_offload.yaml": "DEEPSPEED", "tp.yaml": "MULTI_GPU", "fsdp_tp.yaml": "MULTI_GPU"}


@pytest.mark.quick
def test_the_documented_lines_are_found():
    """The finder sees every file's lines (a change of format must not silently drop them)."""
    sources = {line.source.split(":")[0] for line in documented_lines()}
    configs = {f"accelerate_configs/{p.name}" for p in (ROOT / "accelerate_configs").glob("*.yaml")}
    recipes = {f"recipes/{p.name}" for p in (ROOT / "recipes").glob("*.py")} - {"recipes/generate.py"}
    assert configs | recipes | {"README.md", "configs/finetune.yaml", "configs/pretrain_shakespeare.yaml",
                                "configs/sft.yaml"} <= sources
    # Every line: a new documented line changes this count, and the finder must see it.
    assert len(documented_lines()) == 69, [line.source for line in documented_lines()]


def _workspace(folder):
    """A folder that looks like the repository's root to a line typed there."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("recipes", "accelerate_configs", "configs", "scripts", "train_extras", "tools"):
        if not (folder / name).exists():
            (folder / name).symlink_to(ROOT / name)
    if not (folder / "common").exists():  # a real copy: the README's `cp -r common` must copy files
        shutil.copytree(ROOT / "common", folder / "common", ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def _prepare(command: CpuCommand, folder) -> None:
    """What the line assumes exists: a copied recipe (README), a user's files and Hub model, locally."""
    args = command.recipe_args
    if command.recipe.startswith("my_project/"):  # the README's copy line, as its cp commands do it
        copy = next(line for line in (ROOT / "README.md").read_text().splitlines() if " my_project/" in line
                    and line.startswith(("cp ", "mkdir ")))
        subprocess.run(copy, shell=True, cwd=folder, check=True)
    for flag in ("--data_files", "--eval_data_files"):
        if flag in args and not (folder / args[args.index(flag) + 1]).exists():
            name = args[args.index(flag) + 1]
            if name.endswith(".jsonl"):  # a user's conversations, as docs/data.md#conversations shows them
                conversations_file(folder, 200, name=name)
                continue
            lines = [f"{flag} line {i}: the quick brown fox jumps over the lazy dog." for i in range(400)]
            (folder / name).write_text("\n".join(lines) + "\n")
    if "--model_name_or_path" in args:
        # The line's Hub id as a local folder of that name (transformers reads a local folder first):
        # a debug Llama with the byte tokenizer and Qwen2.5's 32k context; every family is tested in
        # test_model_families.py.
        path = folder / args[args.index("--model_name_or_path") + 1]
        if not path.exists():
            set_seed(0)
            model = build_model(TrainConfig(preset="debug"), 259)
            model.config.max_position_embeddings = 32768
            model.save_pretrained(path)
            tokenizer = build_tokenizer(TrainConfig())
            tokenizer.chat_template = CHAT_TEMPLATE  # for a line that trains it on conversations
            tokenizer.save_pretrained(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(command: CpuCommand, folder, hf_home) -> list[subprocess.CompletedProcess]:
    env = {**launch_env(hf_home), **command.env}
    env["PYTHONPATH"] = launch_env(hf_home)["PYTHONPATH"]  # the tests' probes, which chain scripts/cpu_harness
    if command.machines == 1:
        # The README's lines as typed (launcher and interpreters); the others with the suite's warm
        # processes (tests/warm_launch.py: accelerate's own worker command, or torchrun's own workers)
        warm = not command.sources[0].startswith("README.md")
        return [warm_or_cold(command.argv(ACCELERATE), env, folder, 900, warm=warm)]
    env = warm_workers_env(env)
    port = _free_port()
    nodes = [subprocess.Popen(command.argv(ACCELERATE, rank, port), cwd=folder, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(command.machines)]
    results = []
    for node in nodes:
        out, err = node.communicate(timeout=900)
        results.append(subprocess.CompletedProcess(node.args, node.returncode, out, err))
    return results


@pytest.fixture(scope="module")
def configs_folder(tmp_path_factory):
    """configs/'s lines share one folder: the fine-tuning line reads the pretraining line's export."""
    return _workspace(tmp_path_factory.mktemp("documented_configs"))


@pytest.mark.parametrize("command", COMMANDS, ids=[c.sources[0] for c in COMMANDS])
def test_each_documented_line_runs_as_written_on_cpu(command, tmp_path, hf_home, configs_folder):
    # configs/'s pretraining and fine-tuning lines share a folder (the second starts from the first's export)
    uses_configs = "--config" in command.recipe_args and "--model_name_or_path" not in command.recipe_args
    folder = configs_folder if uses_configs else _workspace(tmp_path / "workspace")
    _prepare(command, folder)
    before = set(folder.rglob("run_summary.json"))
    results = _run(command, folder, hf_home)
    for result in results:
        assert result.returncode == 0, (command.describe(), command.sources, result.stdout[-2000:],
                                        result.stderr[-4000:])
    assert "done:" in results[0].stdout, results[0].stdout[-2000:]
    summaries = [p for p in folder.rglob("run_summary.json") if p not in before or uses_configs]
    summary = json.loads(max(summaries, key=lambda p: p.stat().st_mtime).read_text())
    setup = summary["setup"]
    # What ran is what the line asked for: the config's strategy and precision, on every process.
    assert setup["mixed_precision"] == expected_precision(command), (command.describe(), setup["mixed_precision"])
    if command.config in DISTRIBUTED_TYPE:
        assert setup["distributed_type"] == DISTRIBUTED_TYPE[command.config], command.describe()
    processes = int(command.launch_args.get("--num_processes", 1))
    assert setup["world_size"] == processes, command.describe()
