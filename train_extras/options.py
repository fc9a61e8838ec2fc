"""train.py's options: every core group, plus the groups of what only it implements."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.config import AccumulationOptions, ConfigError, Fp16Options, RecipeConfig


@dataclass
class CheckpointOptions:
    save_every: int = field(
        default=0, metadata={"help": "Save a resumable checkpoint every N optimizer steps (and at the end); 0 = no."})
    save_total_limit: int = field(default=0, metadata={"help": "Keep only the newest N checkpoints; 0 = keep all."})
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={"help": "'auto' (newest complete checkpoint in output_dir, else start afresh) or a checkpoint."})
    save_on_preemption: bool = field(
        default=True,
        metadata={"help": "On SIGTERM/SIGUSR1: finish the step, save a checkpoint, write requeue.json, exit 75."})
    collective_timeout: int = field(
        default=600,
        metadata={"help": "Seconds a rank waits in a collective (all-reduce, barrier) for the others before it "
                          "stops with an error: bounds the hang when a rank dies or freezes. It also bounds every "
                          "wait for rank 0 alone: tokenising the data on first use, writing a checkpoint or the "
                          "export: raise it if one of those takes longer."})
    max_nonfinite_steps: int = field(
        default=3,
        metadata={"help": "Stop after this many optimizer steps in a row with a NaN/inf loss (each is skipped)."})

    def check(self):
        import os

        if self.save_every < 0 or self.save_total_limit < 0:
            raise ConfigError("--save_every and --save_total_limit must be >= 0")
        if self.resume_from_checkpoint not in (None, "auto"):
            if not os.path.isfile(os.path.join(self.resume_from_checkpoint, "checkpoint.json")):
                raise ConfigError(f"not a complete checkpoint (no checkpoint.json): {self.resume_from_checkpoint}")
        for name in ("collective_timeout", "max_nonfinite_steps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name} must be positive, got {getattr(self, name)}")


@dataclass
class TrackingOptions:
    report_to: list[str] | None = field(
        default=None,
        metadata={"help": "Trackers: any of tensorboard, wandb, trackio (secrets are removed from what they get)."})
    project_name: str = field(default="accelerate-recipes", metadata={"help": "Tracker project name."})
    run_name: str | None = field(default=None, metadata={"help": "Tracker run name; default: the output folder's."})

    def check(self):
        if self.report_to:
            from train_extras.tracking import check_available

            check_available(self.report_to)


@dataclass
class SampleOptions:
    sample_length: int = field(
        default=300,
        metadata={"help": "At the end, print a sample of this many tokens from --sample_prompt (temperature 0.8, "
                          "top-k 200, seeded) and keep it in run_summary.json; 0 = no sample. Cost: one forward "
                          "per token, and under FSDP2 / ZeRO-3 each gathers every weight again (with ZeRO-3 "
                          "parameter offload, from CPU memory): lower it for large sharded models."})
    sample_prompt: str = field(default="\n", metadata={"help": "The fixed prompt the sample continues."})
    sample_at_eval: bool = field(default=False, metadata={"help": "Also sample at every evaluation."})

    def check(self):
        if self.sample_length < 0:
            raise ConfigError(f"--sample_length must be >= 0, got {self.sample_length}")
        if self.sample_length and not self.sample_prompt:
            raise ConfigError("--sample_prompt is empty: give the text the sample should continue")


@dataclass
class CompileOptions:
    compile: bool = field(
        default=False,
        metadata={"help": "torch.compile each decoder layer (accelerate's compile_regions: one compiled block "
                          "reused by all layers)."})


@dataclass
class TrainConfig(CompileOptions, SampleOptions, TrackingOptions, CheckpointOptions, Fp16Options,
                  AccumulationOptions, RecipeConfig):
    """Every option of train.py."""
