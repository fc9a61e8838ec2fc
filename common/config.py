"""Training options: one dataclass, parsed from the command line and optionally a YAML file.

    accelerate launch recipes/train.py --config my_run.yaml --lr 1e-3

Precedence: dataclass default < YAML file (``--config``) < command line. The YAML file holds the
same keys as the command-line options (without ``--``). Unknown options and unknown YAML keys are
errors: a typo must never silently train with a default.

The strategy (DDP, FSDP, DeepSpeed, mixed precision, number of processes) is *not* here: it comes
from the accelerate launch config (``accelerate_configs/*.yaml``).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Literal

import torch
import yaml
from transformers import HfArgumentParser

PRESET_NAMES = ("debug", "mini", "tiny", "small", "1b", "8b")


class ConfigError(ValueError):
    """Bad user input (option, file, data). Recipes print it as one line and exit with code 2."""


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss stays NaN). One line, exit code 3."""


@dataclass
class TrainConfig:
    # --- run ---
    config: str | None = field(
        default=None, metadata={"help": "YAML file of options (same keys as the CLI); CLI wins."}
    )
    output_dir: str = field(default="outputs/run", metadata={"help": "Folder for run_summary.json and the model."})
    seed: int = field(default=1234, metadata={"help": "Seed for init, data order and dropout."})

    # --- model ---
    preset: str = field(
        default="mini",
        metadata={"help": f"Random-init Llama preset: {', '.join(PRESET_NAMES)}. Ignored with --model_name_or_path."},
    )
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Local folder or Hub id of a causal LM to start from (its tokenizer too)."}
    )
    tokenizer_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Tokenizer (AutoTokenizer). Default: the model's, else a byte-level one (no download)."},
    )
    gradient_checkpointing: bool = field(
        default=False, metadata={"help": "Recompute activations in backward: less memory, ~30%% more compute."}
    )

    # --- data ---
    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub dataset id (or local dataset folder) for datasets.load_dataset."}
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_split: str = field(default="train", metadata={"help": "Split to train on; a held-out part is cut from it."})
    data_files: list[str] | None = field(
        default=None, metadata={"help": "Local .txt / .json / .jsonl files (one format per run)."}
    )
    text_column: str = field(default="text", metadata={"help": "Column holding the text in JSON/Hub data."})
    builtin_corpus: Literal["shakespeare", "synthetic"] = field(
        default="shakespeare",
        metadata={"help": "Data when neither --data_files nor --dataset_name is given: tiny Shakespeare (shipped "
                          "in common/corpus, read as it is), or a generated toy language (tests use its properties)."},
    )
    synthetic_documents: int = field(
        default=8000,
        metadata={"help": "Documents in the synthetic corpus (--builtin_corpus synthetic, ~250 bytes each)."},
    )
    eval_fraction: float | None = field(
        default=None,
        metadata={"help": "Fraction held out for eval. Default: tiny Shakespeare's last 10%% (nanoGPT's split); "
                          "2%% of the documents, chosen at random with a fixed seed, for every other source."},
    )
    seq_len: int = field(default=256, metadata={"help": "Tokens per training sequence (context length)."})
    packing: bool = field(
        default=True,
        metadata={"help": "Pack documents into full blocks; false = one document per row, right-padded, "
                          "labels -100 on padding (the fine-tuning case; longer documents are truncated)."},
    )
    num_workers: int = field(default=0, metadata={"help": "DataLoader worker processes per rank."})

    # --- optimisation ---
    micro_batch_size: int = field(default=16, metadata={"help": "Sequences per device per forward pass."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step."})
    # The defaults are the quickstart's job: the lowest held-out loss on tiny Shakespeare that a
    # 2-core CPU reaches in about 3 minutes of training (measured; README "Quickstart").
    max_steps: int = field(default=720, metadata={"help": "Optimizer steps to train."})
    lr: float = field(default=4e-3, metadata={"help": "Peak learning rate."})
    lr_schedule: Literal["cosine", "linear", "constant", "wsd"] = field(
        default="cosine", metadata={"help": "Learning-rate schedule after warmup (transformers' implementations)."}
    )
    warmup_steps: int = field(default=15, metadata={"help": "Linear warmup, in optimizer steps."})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "Final LR as a fraction of --lr (cosine, wsd)."})
    decay_fraction: float = field(default=0.2, metadata={"help": "wsd only: fraction of steps spent decaying."})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW decoupled weight decay (matrices only)."})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.95, metadata={"help": "AdamW beta2."})
    adam_eps: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip the global grad norm to this; 0 disables."})
    fp16_init_scale: float = field(
        default=65536.0, metadata={"help": "fp16 only: the GradScaler's initial loss scale (halved on each overflow)."}
    )
    max_nonfinite_steps: int = field(
        default=3, metadata={"help": "Stop after this many optimizer steps in a row with a NaN/inf loss (each is skipped)."}
    )

    # --- eval, logging, export ---
    eval_every: int = field(default=240, metadata={"help": "Evaluate every N optimizer steps (and at 0 and end); 0 = never."})
    eval_batches: int = field(default=0, metadata={"help": "Max eval batches per evaluation; 0 = the whole held-out split."})
    log_every: int = field(default=10, metadata={"help": "Refresh the progress bar / log every N steps."})
    save_model: bool = field(default=True, metadata={"help": "Write a Hugging Face folder (safetensors) at the end."})
    report_to: list[str] | None = field(
        default=None,
        metadata={"help": "Trackers: any of tensorboard, wandb, trackio (secrets are removed from what they get)."},
    )
    project_name: str = field(default="accelerate-recipes", metadata={"help": "Tracker project name."})
    run_name: str | None = field(default=None, metadata={"help": "Tracker run name; default: the output folder's name."})
    sample_length: int = field(
        default=300,
        metadata={"help": "train.py: at the end, print a sample of this many tokens from --sample_prompt (temperature "
                          "0.8, top-k 200, seeded) and keep it in run_summary.json; 0 = no sample. Cost: one forward "
                          "per token, and under FSDP2 / ZeRO-3 each gathers every weight again (with ZeRO-3 "
                          "parameter offload, from CPU memory): lower it for large sharded models."},
    )
    sample_prompt: str = field(default="\n", metadata={"help": "The fixed prompt the sample continues."})
    sample_at_eval: bool = field(default=False, metadata={"help": "Also sample at every evaluation."})
    compile: bool = field(
        default=False,
        metadata={"help": "torch.compile each decoder layer (regional: one compiled block reused by all layers)."},
    )

    # --- checkpoints (train.py) ---
    save_every: int = field(
        default=0, metadata={"help": "Save a resumable checkpoint every N optimizer steps (and at the end); 0 = never."}
    )
    save_total_limit: int = field(default=0, metadata={"help": "Keep only the newest N checkpoints; 0 = keep all."})
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={"help": "'auto' (newest complete checkpoint in output_dir, else start fresh) or a checkpoint folder."},
    )
    save_on_preemption: bool = field(
        default=True,
        metadata={"help": "On SIGTERM/SIGUSR1: finish the step, save a checkpoint, write requeue.json, exit 75."},
    )
    collective_timeout: int = field(
        default=600,
        metadata={"help": "Seconds a rank waits in a collective (all-reduce, barrier) for the others before it "
                          "stops with an error: bounds the hang when a rank dies or freezes. It also bounds every "
                          "wait for rank 0 alone: tokenising the data on first use, writing a checkpoint or the "
                          "export: raise it if one of those takes longer."},
    )
    log_sample_ids: bool = field(
        default=False, metadata={"help": "Record every batch's sample ids per rank in run_summary.json (resume tests)."}
    )

    def __post_init__(self):
        # Checks that need no model and no data: they run before anything heavy.
        if self.model_name_or_path is None and self.preset not in PRESET_NAMES:
            raise ConfigError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESET_NAMES)}")
        if self.data_files and self.dataset_name:
            raise ConfigError("give either --data_files or --dataset_name, not both")
        for path in self.data_files or []:
            if not os.path.isfile(path):
                raise ConfigError(f"data file not found: {path}")
            if not _has_text(path):
                raise ConfigError(f"data file is empty: {path}")
        positive = ("seq_len", "micro_batch_size", "gradient_accumulation_steps", "max_steps",
                    "synthetic_documents")
        if self.sample_length < 0:
            raise ConfigError(f"--sample_length must be >= 0, got {self.sample_length}")
        if self.sample_length and not self.sample_prompt:
            raise ConfigError("--sample_prompt is empty: give the text the sample should continue")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name} must be positive, got {getattr(self, name)}")
        if self.eval_fraction is not None and not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(f"--eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.warmup_steps < 0 or self.warmup_steps > self.max_steps:
            raise ConfigError(f"--warmup_steps must be in [0, max_steps={self.max_steps}], got {self.warmup_steps}")
        if self.save_every < 0 or self.save_total_limit < 0:
            raise ConfigError("--save_every and --save_total_limit must be >= 0")
        if self.resume_from_checkpoint not in (None, "auto"):
            marker = os.path.join(self.resume_from_checkpoint, "checkpoint.json")
            if not os.path.isfile(marker):
                raise ConfigError(f"not a complete checkpoint (no checkpoint.json): {self.resume_from_checkpoint}")
        if self.fp16_init_scale <= 0 or self.max_nonfinite_steps <= 0:
            raise ConfigError("--fp16_init_scale and --max_nonfinite_steps must be positive")
        if self.report_to:
            from common.tracking import check_available

            check_available(self.report_to)
        if self.collective_timeout <= 0:
            raise ConfigError(f"--collective_timeout must be positive, got {self.collective_timeout}")
        if self.lr <= 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch_size * self.seq_len


def _has_text(path: str, chunk: int = 1 << 16) -> bool:
    """True once a non-whitespace byte is found; reads only as far as it must."""
    with open(path, "rb") as f:
        while block := f.read(chunk):
            if block.strip():
                return True
    return False


COLLECTIVE_FAILURE_EXIT_CODE = 4


def one_line(err: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`, for error lines that must stay one line."""
    first = (str(err).strip().splitlines() or [""])[0][:limit]
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def _is_collective_failure(err: BaseException) -> bool:
    """A collective that failed because a peer died (connection closed) or hung (timeout)."""
    import torch.distributed as dist

    if isinstance(err, dist.DistError):
        return True
    text = str(err).lower()
    # gloo's words for a dead peer and for a collective timeout; NCCL's watchdog aborts the process itself
    return isinstance(err, RuntimeError) and dist.is_initialized() and any(
        needle in text for needle in ("connection closed by peer", "connection reset by peer", "timed out waiting",
                                      "broken pipe"))


def _say(line: str) -> None:
    """Write one line to stderr in ONE write: every rank shares the launcher's stderr, and print()
    writes the newline separately, so two ranks' lines could run together (seen in a test log)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def run_cli(main, argv: list[str] | None = None) -> int:
    """Run a recipe's main(): bad input becomes one line on stderr and exit code 2, a training
    failure exit code 3, a failed collective (a lost rank) exit code 4, preemption exit code 75."""
    from common.preemption import EXIT_CODE as PREEMPTED_EXIT_CODE, Preempted

    try:
        main(argv)
    except ConfigError as err:
        _say(f"error: {err}")
        return 2
    except TrainingError as err:
        _say(f"error: {err}")
        return 3
    except Preempted as err:
        _say(f"stopped: {err}")
        return PREEMPTED_EXIT_CODE
    except Exception as err:
        if not _is_collective_failure(err):
            raise
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else "?"
        traceback.print_exc()  # where it failed; our one line follows
        # (starts a line of its own: the failure can strike with the progress bar mid-line)
        _say(f"\nerror: rank {rank}: a collective failed ({one_line(err)}): another rank died "
             "or stopped responding (see the first error above, or --collective_timeout); stopping")
        # Skip the interpreter's teardown: destroying a process group whose peer is gone can hang.
        os._exit(COLLECTIVE_FAILURE_EXIT_CODE)
    finally:
        # Free reference cycles now, while the interpreter is fully alive: gloo work objects kept
        # by FSDP2 hold tensors, and freeing them during interpreter shutdown can abort the
        # process ("terminate called without an active exception", seen ~1 in 8 CPU FSDP runs).
        # In `finally`: a preempted or failed run exits through here too.
        gc.collect()
    return 0


class _OneLineErrorParser(HfArgumentParser):
    """argparse prints usage plus the error and exits; we raise so the recipe prints one line."""

    def error(self, message):
        raise ConfigError(message)


def _yaml_to_argv(path: str) -> list[str]:
    """Turn a YAML mapping into CLI tokens, so YAML values get the same type checks as the CLI."""
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
    if values is None:
        return []
    if not isinstance(values, dict):
        raise ConfigError(f"bad YAML in {path}: expected a mapping of option: value, got {type(values).__name__}")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    argv = []
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"unknown option {key!r} in {path}")
        if key == "config":
            raise ConfigError(f"{path}: a config file cannot name another config file")
        if value is None:
            continue
        argv.append(f"--{key}")
        if isinstance(value, list):
            argv.extend(str(v) for v in value)
        elif isinstance(value, bool):
            argv.append("true" if value else "false")
        else:
            argv.append(str(value))
    return argv


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """Parse CLI (and the YAML it names) into a validated TrainConfig; raise ConfigError on bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _OneLineErrorParser(TrainConfig)
    first, _ = parser.parse_known_args(argv)
    yaml_argv = _yaml_to_argv(first.config) if first.config else []
    # YAML first, CLI after: argparse keeps the last occurrence, so the CLI overrides the file.
    cfg, remaining = parser.parse_args_into_dataclasses(
        args=yaml_argv + argv, return_remaining_strings=True, look_for_args_file=False
    )
    if remaining:
        raise ConfigError(f"unknown option(s): {' '.join(remaining)} (see --help)")
    return cfg


def tensor_parallel_size(accelerator) -> int:
    """Ranks that share one batch and split the model's matrices (accelerate's parallelism_config)."""
    pc = getattr(accelerator, "parallelism_config", None)
    return pc.tp_size if pc is not None and pc.tp_enabled else 1


def data_parallel_size(accelerator) -> int:
    """Ranks that see different batches: the world size over the tensor-parallel size."""
    return accelerator.num_processes // tensor_parallel_size(accelerator)


def describe_setup(cfg: TrainConfig, accelerator, extra: dict | None = None, data_ranks: int | None = None) -> str:
    """The one block printed at start: what really runs, and the global batch it implies.
    data_ranks: ranks with batches of their own, where the recipe knows better than the mesh (pipeline: 1)."""
    world = data_ranks or data_parallel_size(accelerator)
    seqs = cfg.micro_batch_size * cfg.gradient_accumulation_steps * world
    tp = tensor_parallel_size(accelerator)
    lines = [
        "=" * 72,
        f"distributed_type : {accelerator.distributed_type.value}",
        f"world_size       : {accelerator.num_processes}"
        + (f" = {world} data-parallel x {tp} tensor-parallel" if tp > 1 else ""),
        f"mixed_precision  : {accelerator.mixed_precision}",
        f"device           : {accelerator.device}"
        + (f" ({torch.get_num_threads()} torch threads per process)" if accelerator.device.type == "cpu" else ""),
        f"global batch     : {seqs} sequences = {cfg.micro_batch_size} micro x {cfg.gradient_accumulation_steps} accum"
        f" x {world} {'data-parallel ' if tp > 1 else ''}ranks; {seqs * cfg.seq_len:,} tokens (seq_len {cfg.seq_len})",
    ]
    for key, value in (extra or {}).items():
        lines.append(f"{key:<17}: {value}")
    from common.tracking import redact

    # logs get copied around: print the options with secrets removed, as the trackers get them
    lines.append("options          : " + json.dumps(redact(dataclasses.asdict(cfg)), sort_keys=True))
    lines.append("=" * 72)
    return "\n".join(lines)


def setup_facts(cfg: TrainConfig, accelerator, data_ranks: int | None = None) -> dict:
    """The resolved setup as plain data, for run_summary.json (and later, checkpoints)."""
    from common.tracking import redact

    world = data_ranks or data_parallel_size(accelerator)
    return {
        "options": redact(dataclasses.asdict(cfg)),  # checkpoint.json keeps the exact options for resume
        "distributed_type": accelerator.distributed_type.value,
        "world_size": accelerator.num_processes,
        # ranks with different batches x ranks splitting the model's matrices (1 without TP)
        "data_parallel_size": world,
        "tensor_parallel_size": tensor_parallel_size(accelerator),
        "mixed_precision": accelerator.mixed_precision,
        "device": str(accelerator.device),
        "cpu_threads": torch.get_num_threads() if accelerator.device.type == "cpu" else None,
        "global_batch_sequences": cfg.micro_batch_size * cfg.gradient_accumulation_steps * world,
        "global_batch_tokens": cfg.micro_batch_size * cfg.gradient_accumulation_steps * world * cfg.seq_len,
        # Which code ran: a recipe copied out with its own common/ must use that copy.
        "code": {"recipe": os.path.abspath(sys.argv[0]), "common": os.path.dirname(os.path.abspath(__file__))},
    }
