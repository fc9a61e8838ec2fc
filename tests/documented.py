"""Every launch line the docs show (README, accelerate_configs/ and configs/ headers, recipe
docstrings), read from the files, and the CPU form a test launches: the same line with only what
a CPU machine needs changed. tests/test_documented_commands.py launches each distinct CPU form.

What a CPU needs, and nothing else:
- the environment that makes a GPU config run on CPU processes (ACCELERATE_USE_CPU for DDP, the
  CPU harness for FSDP2, DeepSpeed, TP and fp16's GradScaler; `--cpu` for fp16.yaml, as its
  header's rehearsal line says);
- fewer processes: 2 (4 where the mesh has two dimensions), the mesh sizes that go with them, one
  thread each; two "machines" on 127.0.0.1 instead of a cluster's address;
- the `debug` preset instead of a large one, and a short run: a few steps (`--max_steps`, a warmup
  that fits), a few held-out batches per eval (`--eval_batches`) and, for train.py, a short end
  sample (`--sample_length`): 2 CPU cores would spend minutes on full evals in bf16 or fp16.
A Hub id or a file the line names (`Qwen/Qwen2.5-0.5B`, `my_docs.txt`) is made locally under that
very name in the folder the line runs in, so the line itself stays as written.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

# ---- finding the lines ----


@dataclass(frozen=True)
class DocLine:
    source: str  # file:line where the command starts
    text: str    # the command, continuation lines joined, comments and "machine N:" prefixes removed


_ENV = r"(?:[A-Z_][A-Z0-9_]*=\S+\s+)*"
_COMMAND = re.compile(rf"({_ENV}accelerate launch\b.*)")


def _joined(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(line number, text) with backslash continuations joined onto their first line."""
    out, start, parts = [], None, []
    for number, text in lines:
        if start is None:
            start = number
        stripped = text.rstrip()
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].strip())
            continue
        parts.append(stripped.strip())
        out.append((start, " ".join(p for p in parts if p)))
        start, parts = None, []
    if parts:
        out.append((start, " ".join(parts)))
    return out


def _commands(source: str, lines: list[tuple[int, str]]) -> list[DocLine]:
    found = []
    for number, text in _joined(lines):
        match = _COMMAND.search(text)
        if not match or "`" in text:  # prose that names `accelerate launch` in backquotes
            continue
        command = re.sub(r"\s+#.*$", "", match.group(1)).strip()  # a trailing "# why" comment
        if "<" in command:  # a template (<config>), not a command
            continue
        found.append(DocLine(f"{source}:{number}", command))
    return found


def _header(path: Path) -> list[tuple[int, str]]:
    """The comment block a YAML file starts with, without the '#'."""
    lines = []
    for number, text in enumerate(path.read_text().splitlines(), 1):
        if not text.startswith("#"):
            break
        lines.append((number, re.sub(r"^#\s?", "", text)))
    return lines


def _docstring(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    end = text.index('"""', 3)
    return [(n, line) for n, line in enumerate(text[3:end].splitlines(), 1)]


def _readme() -> list[tuple[int, str]]:
    lines, in_bash = [], False
    for number, text in enumerate((ROOT / "README.md").read_text().splitlines(), 1):
        if text.startswith("```"):
            in_bash = text.strip() == "```bash"
            continue
        if in_bash:
            lines.append((number, text.split("&&")[-1]))  # `pip install ... && accelerate launch ...`
    return lines


def documented_lines() -> list[DocLine]:
    found = _commands("README.md", _readme())
    for folder in ("accelerate_configs", "configs"):
        for path in sorted((ROOT / folder).glob("*.yaml")):
            found += _commands(f"{folder}/{path.name}", _header(path))
    for path in sorted((ROOT / "recipes").glob("*.py")):
        found += _commands(f"recipes/{path.name}", _docstring(path))
    return found


# ---- the CPU form ----
DDP_CONFIGS = {"ddp.yaml", "multi_node_ddp.yaml"}
HARNESS_CONFIGS = {"fsdp.yaml", "fsdp_offload.yaml", "fsdp_shard_grad_op.yaml", "fsdp_tp.yaml", "tp.yaml",
                   "multi_node_fsdp.yaml", "multi_node_hsdp.yaml", "deepspeed_zero1.yaml", "deepspeed_zero2.yaml",
                   "deepspeed_zero3.yaml", "deepspeed_zero3_offload.yaml", "fp16.yaml"}
# Processes and mesh sizes on CPU, by config (the rest of a multi-process config: 2 processes).
CPU_MESH = {
    "tp.yaml": {"--num_processes": "2", "--parallelism_config_tp_size": "2"},
    "fsdp_tp.yaml": {"--num_processes": "4", "--parallelism_config_dp_shard_size": "2",
                     "--parallelism_config_tp_size": "2"},
    "multi_node_hsdp.yaml": {"--num_processes": "4", "--parallelism_config_dp_replicate_size": "2",
                             "--parallelism_config_dp_shard_size": "2"},
}
FLAGS_WITHOUT_VALUE = {"--cpu", "--multi_gpu", "--use_deepspeed", "--use_fsdp"}
LARGE_PRESETS = {"tiny", "small", "1b", "8b"}


@dataclass
class CpuCommand:
    """One launch (two, started together, for a two-machine line) of a documented line's CPU form."""
    config: str | None
    launch_args: dict[str, str | None]  # accelerate launch's own options, in order
    recipe: str
    recipe_args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    machines: int = 1
    sources: list[str] = field(default_factory=list)

    def key(self) -> tuple:
        return (self.config, tuple(self.launch_args.items()), self.recipe, tuple(self.recipe_args),
                tuple(sorted(self.env.items())), self.machines)

    def argv(self, accelerate: str, machine_rank: int | None = None, port: int | None = None) -> list[str]:
        args = dict(self.launch_args)
        if self.machines > 1:
            args.update({"--machine_rank": str(machine_rank), "--main_process_port": str(port)})
        flat = [token for flag, value in args.items() for token in ((flag,) if value is None else (flag, value))]
        return [accelerate, "launch", *flat, self.recipe, *self.recipe_args]

    def describe(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in sorted(self.env.items()))
        return f"{env} {' '.join(self.argv('accelerate', 'R' if self.machines > 1 else None, 'P'))}".strip()


def yaml_config(config: str | None) -> dict:
    return yaml.safe_load((ROOT / "accelerate_configs" / config).read_text()) if config else {}


def cpu_form(line: DocLine, steps: list[str]) -> CpuCommand:
    """The CPU form of a documented line; `steps`: the few-steps options a test appends."""
    tokens = shlex.split(line.text)
    env = {}
    while "=" in tokens[0] and not tokens[0].startswith("-"):
        name, value = tokens.pop(0).split("=", 1)
        env[name] = value
    assert tokens[:2] == ["accelerate", "launch"], line
    tokens = tokens[2:]
    launch_args: dict[str, str | None] = {}
    while tokens and tokens[0].startswith("--"):
        flag = tokens.pop(0)
        launch_args[flag] = None if flag in FLAGS_WITHOUT_VALUE else tokens.pop(0)
    recipe, recipe_args = tokens[0], tokens[1:]
    config = Path(launch_args["--config_file"]).name if "--config_file" in launch_args else None
    yaml_cfg = yaml_config(config) if config else {}  # the README's copy (my_project/fsdp.yaml) is fsdp.yaml

    # The CPU's environment. PYTHONPATH=scripts/cpu_harness is kept: the tests' probes chain it.
    if config in DDP_CONFIGS or (config is None and "--multi_gpu" in launch_args):
        env.setdefault("ACCELERATE_USE_CPU", "true")
    if config in HARNESS_CONFIGS:
        env.setdefault("ACCELERATE_RECIPES_CPU_HARNESS", "1")
        env.setdefault("PYTHONPATH", "scripts/cpu_harness")
    if config == "fp16.yaml":
        launch_args.setdefault("--cpu", None)  # the header's rehearsal: the harness adds torch's CPU GradScaler
    # Fewer processes (and the mesh that goes with them), two machines on this host.
    machines = int(launch_args.get("--num_machines", yaml_cfg.get("num_machines", 1)))
    processes = int(launch_args.get("--num_processes", yaml_cfg.get("num_processes", 1)))
    if processes > 1:
        launch_args.update(CPU_MESH.get(config, {"--num_processes": "2"}))
        launch_args["--num_cpu_threads_per_process"] = "1"
    if machines > 1:
        launch_args.pop("--machine_rank", None)
        launch_args.pop("--main_process_port", None)
        launch_args.update({"--num_machines": "2", "--main_process_ip": "127.0.0.1"})
    # A small model, a few steps.
    if "--preset" in recipe_args:
        at = recipe_args.index("--preset") + 1
        if recipe_args[at] in LARGE_PRESETS:
            recipe_args[at] = "debug"
    if "--max_steps" not in recipe_args:
        recipe_args += short_run(recipe, recipe_args, steps)
    launch_args = dict(sorted(launch_args.items(), key=lambda item: (item[0] != "--config_file", item[0])))
    return CpuCommand(config, launch_args, recipe, recipe_args, env, machines, [line.source])


def short_run(recipe: str, recipe_args: list[str], steps: list[str]) -> list[str]:
    """`steps` (["--max_steps", N, "--warmup_steps", W]) without the warmup when the line's --config
    file sets a warmup ratio (the steps would replace it), plus few eval batches, a short sample."""
    if "--config" in recipe_args:
        options = yaml.safe_load((ROOT / recipe_args[recipe_args.index("--config") + 1]).read_text()) or {}
        if "warmup_ratio" in options:
            steps = steps[:2]
    return [*steps, "--eval_batches", "2", *(["--sample_length", "16"] if recipe.endswith("train.py") else [])]


def expected_precision(command: CpuCommand) -> str:
    """What the run must report: the command line's --mixed_precision, else the DeepSpeed JSON's
    explicit choice (it decides under DeepSpeed), else the YAML's."""
    if "--mixed_precision" in command.launch_args:
        return command.launch_args["--mixed_precision"]
    from common.guard import deepspeed_json_precision  # what the start-up guard takes as asked

    cfg = yaml_config(command.config) if command.config else {}
    json_file = (cfg.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if json_file:
        return deepspeed_json_precision(str(ROOT / json_file)) or "no"
    return str(cfg.get("mixed_precision", "no"))


def distinct_cpu_commands(steps: list[str]) -> list[CpuCommand]:
    """Each documented line's CPU form once: lines whose forms are equal (a GPU line and its CPU
    rehearsal, the two machines of one multi-node example) are one launch, in document order."""
    commands: dict[tuple, CpuCommand] = {}
    for line in documented_lines():
        command = cpu_form(line, list(steps))
        if command.key() in commands:
            commands[command.key()].sources.append(line.source)
        else:
            commands[command.key()] = command
    return list(commands.values())
