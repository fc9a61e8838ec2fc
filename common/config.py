"""Options and errors. A recipe's options are the core groups below plus the groups of its own
technique, composed into one dataclass and parsed by transformers' HfArgumentParser:

    accelerate launch recipes/bf16_baseline.py --config my_run.yaml --lr 1e-3

Precedence: default < YAML file (``--config``, same keys) < command line. An option the recipe does
not have is an error naming the recipe: a typo, or another recipe's feature, must never silently
train with a default. The strategy (DDP, FSDP, DeepSpeed, precision, processes) is not an option:
it comes from the accelerate launch config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import yaml
from transformers import HfArgumentParser

PRESET_NAMES = ("debug", "mini", "tiny", "small", "1b", "8b")


class RecipeStop(Exception):
    """An expected stop: one line on stderr (`prefix: message`) and the exit code, no traceback."""
    exit_code, prefix, every_rank = 1, "error", False  # every_rank: see same_on_every_rank


class ConfigError(RecipeStop, ValueError):
    """Bad input (option, file, data, checkpoint), found before any training. Exit code 2."""
    exit_code = 2


class TrainingError(RecipeStop, RuntimeError):
    """Training cannot go on (e.g. the loss stays NaN). Exit code 3."""
    exit_code = 3


def opt(default, help: str):
    """An option: its default and its --help text."""
    return field(default=default, metadata={"help": help})


@dataclass
class RunOptions:
    config: str | None = opt(None, "YAML file of options (same keys); the CLI wins.")
    output_dir: str = opt("outputs/run", "Folder for run_summary.json and the model.")
    seed: int = opt(1234, "Seed for init, data order and dropout.")


@dataclass
class ModelOptions:
    preset: str = opt("mini", f"Random-init Llama preset: {', '.join(PRESET_NAMES)}. Ignored with a model path.")
    model_name_or_path: str | None = opt(None, "Local folder or Hub id of a causal LM to start from (+ its tokenizer).")
    tokenizer_name_or_path: str | None = opt(None, "Tokenizer (AutoTokenizer). Default: the model's, else bytes.")
    gradient_checkpointing: str = field(default="false", metadata={
        "help": "Recompute activations in backward. true: every block keeps only its input (least memory, "
                "~30%% more compute); selective: keep matmul and attention outputs, recompute the element-wise "
                "rest and cheap matmuls such as LoRA's up-projections (common/model._keeps); false. Alone, the "
                "flag means true.",
        "nargs": "?", "const": "true", "choices": ("true", "selective", "false")})
    trust_remote_code: bool = opt(False, "Run the Python code a model or tokenizer folder ships (auto_map in its "
                                         "config). Off: such a folder is refused; a built-in model never needs it.")
    attn_implementation: str = opt("auto", "Attention kernel (transformers' name): auto (transformers' choice: sdpa "
                                           "where the model has it, else eager), sdpa, eager, flash_attention_2...")

    def check(self):
        if isinstance(self.gradient_checkpointing, bool):  # from code: ...Config(gradient_checkpointing=True)
            self.gradient_checkpointing = "true" if self.gradient_checkpointing else "false"
        if self.gradient_checkpointing not in ("true", "selective", "false"):
            raise ConfigError(f"--gradient_checkpointing {self.gradient_checkpointing}: choose true, selective "
                              "or false")
        if self.model_name_or_path is None and self.preset not in PRESET_NAMES:
            raise ConfigError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESET_NAMES)}")
        for flag, name in (("model", self.model_name_or_path), ("tokenizer", self.tokenizer_name_or_path)):
            if name and name.startswith(("/", ".")) and not os.path.isdir(name):  # a local path, not a Hub id
                raise ConfigError(f"--{flag}_name_or_path {name}: no such local folder")


@dataclass
class DataOptions:
    dataset_name: str | None = opt(None, "Hub dataset id (or local dataset folder) for datasets.load_dataset.")
    dataset_config: str | None = opt(None, "Dataset configuration name.")
    dataset_split: str = opt("train", "Split to train on (a held-out part is cut from it unless --eval_split).")
    eval_split: str | None = opt(None, "The dataset's own held-out split (e.g. validation), instead of a cut of train.")
    data_files: list[str] | None = opt(None, "Local .txt/.json/.jsonl/.csv/.parquet files, folders or globs (one "
                                             "format). Default: none given = tiny Shakespeare, in common/corpus/.")
    eval_data_files: list[str] | None = opt(None, "Local files (folders, globs) held out, instead of a cut of train.")
    txt_documents: Literal["paragraph", "line", "file"] = opt(
        "paragraph", "How a .txt file splits into documents: at blank lines, at every line, or one per file.")
    text_column: str = opt("text", "Column holding the text in JSON, CSV, Parquet or Hub data.")
    eval_fraction: float | None = opt(None, "Fraction held out for eval. Default: tiny Shakespeare's last 10%% "
                                           "(nanoGPT's split); 2%% of the documents (fixed seed) for other sources.")
    add_bos: bool = opt(True, "Start each document with the tokenizer's BOS, if it has one apart from EOS.")
    seq_len: int = opt(256, "Tokens per training sequence (context length).")
    packing: bool = opt(True, "Pack documents into full blocks; false = one document per row, right-padded, "
                              "labels -100 on padding (the fine-tuning case; longer documents are truncated).")
    num_workers: int = opt(0, "DataLoader worker processes per rank.")

    def check(self):
        if self.data_files and self.dataset_name:
            raise ConfigError("give either --data_files or --dataset_name, not both")
        if (self.eval_split and not self.dataset_name) or (self.eval_data_files and not self.data_files):
            raise ConfigError("--eval_split goes with --dataset_name, --eval_data_files with --data_files")
        if self.eval_fraction is not None and (self.eval_split or self.eval_data_files):
            raise ConfigError("--eval_fraction cuts the held-out part from train: not with a held-out set of its own")
        data_file_list(self.data_files), data_file_list(self.eval_data_files)  # there, not empty, one format
        if self.eval_fraction is not None and not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(f"--eval_fraction must be in (0, 1), got {self.eval_fraction}")
        _positive(self, "seq_len")


@dataclass
class OptimizerOptions:
    micro_batch_size: int = opt(16, "Sequences per device per forward pass.")
    # The defaults are the quickstart's job: the lowest held-out loss on tiny Shakespeare that a
    # 2-core CPU reaches in about 3 minutes of training (measured; README "Quickstart").
    max_steps: int = opt(720, "Optimizer steps to train.")
    # --lr and --warmup_ratio: from a sweep at this job's shape and nanoGPT's (benchmarks/lr_sweep.py).
    lr: float = opt(4e-3, "Peak learning rate.")
    lr_schedule: Literal["cosine", "linear", "constant", "wsd"] = opt("cosine", "LR schedule after the warmup.")
    warmup_ratio: float = opt(0.1, "Linear warmup as a fraction of --max_steps (rounded to steps).")
    warmup_steps: int | None = opt(None, "Linear warmup in optimizer steps; given, it replaces --warmup_ratio.")
    min_lr_ratio: float = opt(0.1, "Final LR as a fraction of --lr (cosine, wsd).")
    decay_fraction: float = opt(0.2, "wsd only: fraction of steps spent decaying.")
    weight_decay: float = opt(0.1, "AdamW decoupled weight decay (matrices only).")
    adam_beta1: float = opt(0.9, "AdamW beta1.")
    adam_beta2: float = opt(0.95, "AdamW beta2.")
    adam_eps: float = opt(1e-8, "AdamW epsilon.")
    max_grad_norm: float = opt(1.0, "Clip the global grad norm to this; 0 disables.")

    def check(self):
        _positive(self, "micro_batch_size", "max_steps", "lr")
        if not 0.0 <= self.warmup_ratio <= 1.0:
            raise ConfigError(f"--warmup_ratio must be in [0, 1], got {self.warmup_ratio}")
        if self.warmup_steps is None:  # given, the steps win over the ratio
            self.warmup_steps = round(self.warmup_ratio * self.max_steps)
        if self.warmup_steps < 0 or self.warmup_steps > self.max_steps:
            raise ConfigError(f"--warmup_steps must be in [0, max_steps={self.max_steps}], got {self.warmup_steps}")


@dataclass
class EvalOptions:
    eval_every: int = opt(240, "Evaluate every N optimizer steps (and at 0 and end); 0 = never.")
    eval_batches: int = opt(0, "Max eval batches per evaluation; 0 = the whole held-out split.")
    log_every: int = opt(10, "Refresh the progress bar / log every N steps.")
    save_model: bool = opt(True, "Write a Hugging Face folder (safetensors) at the end.")


@dataclass
class RecipeConfig(EvalOptions, OptimizerOptions, DataOptions, ModelOptions, RunOptions):
    """The options every recipe has. A recipe adds its technique's groups as bases (their order is
    the order of --help) and writes its own `check_order` with them in; one that adds none keeps this."""
    check_order = (ModelOptions, DataOptions, OptimizerOptions)  # the groups' check(), run in this order

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _check_order_is_complete(cls)

    def __post_init__(self):  # the checks need no model and no data, so they run first
        for group in self.check_order:
            group.check(self)


def _check_order_is_complete(cls) -> None:
    """`check_order` names, once each, every base of `cls` with a check() of its own, and nothing else."""
    listed, have = list(cls.check_order), [base for base in cls.__mro__ if "check" in vars(base)]
    problems = [f"{group.__name__} is missing" for group in have if group not in listed]
    problems += [f"{getattr(group, '__name__', group)} is not a base with a check() of its own"
                 for group in listed if group not in have]
    problems += [f"{group.__name__} is listed twice" for group in dict.fromkeys(listed) if listed.count(group) > 1]
    if problems:
        raise TypeError(f"{cls.__name__}.check_order: {'; '.join(problems)}")


# Groups of the recipes that implement them (a recipe lists only the groups it uses).
@dataclass
class AccumulationOptions:
    gradient_accumulation_steps: int = opt(1, "Micro-batches per optimizer step.")

    def check(self):
        _positive(self, "gradient_accumulation_steps")


@dataclass
class Fp16Options:
    fp16_init_scale: float = opt(65536.0, "fp16 only: the GradScaler's initial loss scale (halved on each overflow).")

    def check(self):
        _positive(self, "fp16_init_scale")


def _positive(options, *names):
    for name in names:
        if getattr(options, name) <= 0:
            raise ConfigError(f"--{name} must be positive, got {getattr(options, name)}")


def _has_text(path: str) -> bool:
    """True once a non-whitespace byte is found; reads only as far as it must (64 KiB at a time)."""
    with open(path, "rb") as f:
        return any(block.strip() for block in iter(lambda: f.read(1 << 16), b""))


# datasets' builder of each file suffix
BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def data_file_list(paths: list[str] | None) -> list[str]:
    """--data_files / --eval_data_files as the files they name, in the order given: a folder gives every
    data file in it and a glob what it matches, by datasets' rules (hidden files, README.md skipped),
    sorted (the data and its cache stay the same run to run). Each file must hold something; one format."""
    files = []
    for path in paths or []:
        if os.path.isfile(path):  # taken as it is (its name may hold [ or *)
            files.append(path)
            continue
        from datasets.data_files import contains_wildcards, resolve_pattern

        folder = os.path.isdir(path)
        try:
            files += sorted(resolve_pattern(os.path.join(path, "**") if folder else path, os.getcwd(),
                                            list(BUILDERS) if folder else None))
        except FileNotFoundError:
            raise ConfigError(f"no {'/'.join(BUILDERS)} file in the folder {path}" if folder else
                              f"no file matches {path}" if contains_wildcards(path) else f"data file not found: {path}"
                              ) from None
    formats = {BUILDERS.get(Path(f).suffix.lower()) for f in files}
    if len(formats) > 1 or None in formats:
        raise ConfigError("data files must all be .txt, all .json/.jsonl, all .csv or all .parquet; got "
                          + ", ".join(sorted({Path(f).suffix or Path(f).name for f in files})))
    for file in files:
        if not _has_text(file):
            raise ConfigError(f"data file is empty: {file}")
    return files


# ---- parsing ----
class _OneLineErrorParser(HfArgumentParser):
    """argparse prints usage plus the error and exits; we raise so the recipe prints one line."""

    def error(self, message):
        raise ConfigError(f"{self.prog}: {message}")


def _yaml_to_argv(path: str, known: set[str], recipe: str, lists: set[str] = frozenset()) -> list[str]:
    """Turn a YAML mapping into CLI tokens, so YAML values get the same type checks as the CLI.
    lists: the options that take several values."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path) as f:
            values = yaml.safe_load(f)
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"bad YAML in {path}{line}: {problem}") from None
    if values in (None, {}):  # nothing, or only comments: a file meant to say something
        raise ConfigError(f"config file {path} is empty")
    if not isinstance(values, dict):
        raise ConfigError(f"bad YAML in {path}: expected a mapping of option: value, got {type(values).__name__}")
    argv = []
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"unknown option {key!r} for {recipe} in {path} (see {recipe} --help)")
        if key == "config":
            raise ConfigError(f"{path}: a config file cannot name another config file")
        if isinstance(value, list) and key not in lists:
            raise ConfigError(f"{path}: {key} takes one value, got a list")
        if value is not None:  # a list gives one token per item; booleans as the CLI spells them
            items = value if isinstance(value, list) else [value]
            argv += [f"--{key}", *(("true" if v else "false") if isinstance(v, bool) else str(v) for v in items)]
    return argv


@contextlib.contextmanager
def same_on_every_rank():
    """A stop raised in here is every rank's alike (same inputs): one process per launcher prints it."""
    try:
        yield
    except RecipeStop as err:
        err.every_rank = True
        raise


@same_on_every_rank()  # every rank parses the same command line
def parse(options_class, argv: list[str] | None = None, recipe: str | None = None):
    """CLI (and the YAML it names) into a validated `options_class`; ConfigError on bad input."""
    recipe = recipe or Path(sys.argv[0]).name
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _OneLineErrorParser(options_class, prog=recipe)
    first, _ = parser.parse_known_args(argv)
    known = {f.name for f in dataclasses.fields(options_class)}
    lists = {action.dest for action in parser._actions if action.nargs in ("+", "*")}
    yaml_argv = _yaml_to_argv(first.config, known, recipe, lists) if first.config else []
    # YAML first, CLI after: argparse keeps the last occurrence, so the CLI overrides the file.
    cfg, remaining = parser.parse_args_into_dataclasses(
        args=yaml_argv + argv, return_remaining_strings=True, look_for_args_file=False)
    if remaining:
        raise ConfigError(f"unknown option(s) for {recipe}: {' '.join(remaining)} (see {recipe} --help)")
    return cfg


# ---- running a recipe ----
def one_line(err: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`, for error lines that must stay one line."""
    first = (str(err).strip().splitlines() or [""])[0][:limit]
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def _say(line: str) -> None:
    """One line in ONE write: ranks share the launcher's stderr, and print() writes the newline apart."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def run_cli(main, argv: list[str] | None = None) -> int:
    """Run a recipe's main(): an expected stop (RecipeStop: bad input 2, training failure 3) becomes
    one line on stderr and its exit code, with no traceback."""
    try:
        main(argv)
    except RecipeStop as err:
        if err.every_rank and os.environ.get("LOCAL_RANK", "0") != "0":
            # The launcher's first process prints the line. Leaving first would have the launcher stop
            # it before it does: wait to be stopped (SIGTERM's default action), a minute at most.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(60)
            return err.exit_code
        _say(f"{err.prefix}: {err}")
        return err.exit_code
    finally:
        # Free reference cycles now, while the interpreter is fully alive: gloo work objects kept
        # by FSDP2 hold tensors, and freeing them during interpreter shutdown can abort the
        # process ("terminate called without an active exception", seen ~1 in 8 CPU FSDP runs).
        gc.collect()
    return 0


# ---- the resolved setup ----
def tensor_parallel_size(accelerator) -> int:
    """Ranks that share one batch and split the model's matrices (accelerate's parallelism_config)."""
    pc = getattr(accelerator, "parallelism_config", None)
    return pc.tp_size if pc is not None and pc.tp_enabled else 1


def data_parallel_size(accelerator) -> int:
    """Ranks that see different batches: the world size over the tensor-parallel size."""
    return accelerator.num_processes // tensor_parallel_size(accelerator)


def setup_facts(cfg, accelerator, options: dict | None = None, data_ranks: int | None = None) -> dict:
    """The resolved setup as plain data (run_summary.json, checkpoints). `options`: what to record
    of cfg (default: all of it; train.py passes them with secrets removed).
    data_ranks: ranks with batches of their own, where the recipe knows better than the mesh (pipeline: 1)."""
    world = data_ranks or data_parallel_size(accelerator)
    accumulation = getattr(cfg, "gradient_accumulation_steps", 1)  # AccumulationOptions, or a recipe's own
    sequences = cfg.micro_batch_size * accumulation * world
    return {  # data_parallel_size: ranks with different batches; tensor_parallel_size: ranks splitting matrices
        "options": dataclasses.asdict(cfg) if options is None else options,
        "distributed_type": accelerator.distributed_type.value, "world_size": accelerator.num_processes,
        "data_parallel_size": world, "tensor_parallel_size": tensor_parallel_size(accelerator),
        "mixed_precision": accelerator.mixed_precision, "device": str(accelerator.device),
        "cpu_threads": torch.get_num_threads() if accelerator.device.type == "cpu" else None,
        "global_batch_sequences": sequences, "global_batch_tokens": sequences * cfg.seq_len,
        # Which code ran: a recipe copied out with its own common/ must use that copy.
        "code": {"recipe": os.path.abspath(sys.argv[0]), "common": os.path.dirname(os.path.abspath(__file__))},
    }


def describe_setup(setup: dict, extra: dict | None = None) -> str:
    """The one block printed at start: what really runs, and the global batch it implies."""
    options, tp = setup["options"], setup["tensor_parallel_size"]
    threads = f" ({setup['cpu_threads']} torch threads per process)" if setup["cpu_threads"] else ""
    lines = [
        "=" * 72, f"distributed_type : {setup['distributed_type']}",
        f"world_size       : {setup['world_size']}"
        + (f" = {setup['data_parallel_size']} data-parallel x {tp} tensor-parallel" if tp > 1 else ""),
        f"mixed_precision  : {setup['mixed_precision']}",
        f"device           : {setup['device']}{threads}",
        f"global batch     : {setup['global_batch_sequences']} sequences = {options['micro_batch_size']} micro x "
        f"{options.get('gradient_accumulation_steps', 1)} accum x {setup['data_parallel_size']} "
        f"{'data-parallel ' if tp > 1 else ''}ranks; {setup['global_batch_tokens']:,} tokens "
        f"(seq_len {options['seq_len']})",
        *(f"{key:<17}: {value}" for key, value in (extra or {}).items()),
        "options          : " + json.dumps(options, sort_keys=True), "=" * 72]
    return "\n".join(lines)
