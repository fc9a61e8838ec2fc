"""train.py's options: every core group, plus the groups of what only it implements."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Literal

from common.config import (AccumulationOptions, ConfigError, DataOptions, Fp16Options, ModelOptions, OptimizerOptions,
                           RecipeConfig)


@dataclass
class CheckpointOptions:
    save_every: int = field(
        default=0, metadata={"help": "Save a resumable checkpoint every N optimizer steps (and at the end); 0 = none "
                                     "kept (one of the final step is saved before the export and removed after it)."})
    save_total_limit: int = field(
        default=0, metadata={"help": "Keep the newest N of this run's checkpoints (never another run's); 0 = all."})
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={"help": "'auto' (newest complete checkpoint in output_dir that verifies, else start afresh, "
                          "said in one line) or a checkpoint."})
    verify_checkpoint: bool = field(
        default=True,
        metadata={"help": "Before resuming, check every checkpoint file's content against its xxh3 checksum "
                          "(false: sizes only; damage in place then goes unseen)."})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Let this run replace a finished run in --output_dir (its run_summary.json, model/). "
                          "Without it such a folder is refused, unless the run resumes one of its checkpoints. The "
                          "old model/ stays until the new export replaces it whole; checkpoints past this run's "
                          "start are still refused; files this project did not write are refused with it too."})
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
            from train_extras.observe.tracking import check_available

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
class FineTuneOptions:
    """Starting from a pretrained model: the export's dtype, eval only."""
    export_dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(
        default="auto", metadata={"help": "Weights' dtype in the exported folder; auto = the run's precision "
                                          "(bf16 run: bfloat16, fp16: float16, no mixed precision: float32)."})
    eval_only: bool = field(
        default=False, metadata={"help": "Evaluate --model_name_or_path (an exported folder or Hub model) or "
                                         "--resume_from_checkpoint on the held-out data, print loss and perplexity, "
                                         "and stop: no training, no export."})

    def check(self):
        if self.eval_only and not (self.model_name_or_path or self.resume_from_checkpoint):
            raise ConfigError("--eval_only evaluates --model_name_or_path or --resume_from_checkpoint: give one")


@dataclass
class DataAtScaleOptions:
    dataset_num_proc: int | None = field(
        default=None, metadata={"help": "Processes that tokenise (datasets.map num_proc); default: one."})
    data_timeout: int = field(
        default=7200, metadata={"help": "Seconds the other ranks wait while rank 0 prepares the data (tokenising, "
                                        "on first use), apart from --collective_timeout."})
    streaming: bool = field(
        default=False, metadata={"help": "Stream --data_files / --dataset_name (datasets' streaming, split per rank) "
                                         "instead of tokenising it all first; needs --eval_split or "
                                         "--eval_data_files. Resume re-reads the stream up to its position."})

    def check(self):
        for name in ("dataset_num_proc", "data_timeout"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"--{name} must be positive, got {getattr(self, name)}")
        if self.streaming:
            if not (self.data_files or self.dataset_name):
                raise ConfigError("--streaming needs --data_files or --dataset_name (tiny Shakespeare is not streamed)")
            if not (self.eval_split or self.eval_data_files):
                raise ConfigError("--streaming needs a held-out set of its own: --eval_split or --eval_data_files")
            if not self.packing:
                raise ConfigError("--streaming packs documents into blocks: not with --packing false")


@dataclass
class DocumentOptions:
    """What a training document is: text or a conversation, packed apart from its neighbours, from
    one source or a mixture (train_extras/data/)."""
    chat_column: str | None = field(
        default=None, metadata={"help": "Column of conversations (lists of {role, content} messages, content a "
                                        "string or OpenAI text parts; or ShareGPT {from, value} turns), rendered by "
                                        "the tokenizer's chat template with the loss on the assistant's tokens only. "
                                        "Default: a column of that shape, if the data has one."})
    chat_template: str | None = field(
        default=None, metadata={"help": "A Jinja chat template file, for a tokenizer without one (or to replace its "
                                        "own); the export keeps it. Refused for data that holds text only."})
    overlong: Literal["drop", "truncate"] = field(
        default="drop", metadata={"help": "A conversation longer than --seq_len + 1 tokens: left out, or cut to it "
                                          "(either is counted in the setup block)."})
    packing_strategy: Literal["auto", "best_fit", "concatenate"] = field(
        default="auto", metadata={"help": "How examples are packed into rows of --seq_len + 1 tokens: best_fit "
                                          "(best-fit decreasing: each example whole in one row, the rest padding) "
                                          "or concatenate (one stream cut into full blocks: no padding, examples "
                                          "split at block edges). auto = best_fit for conversations, "
                                          "prompt/completion pairs and mixtures, concatenate for text."})
    completion_only_loss: bool = field(
        default=True, metadata={"help": "prompt/completion text: the loss on the completion (and its EOS) only; "
                                        "false = on the whole text."})
    last_turn_only: bool = field(
        default=False, metadata={"help": "Conversations: the loss on the last assistant turn only; the earlier "
                                         "turns are context."})
    document_mask: Literal["auto", "true", "false"] = field(
        default="auto", metadata={"help": "Packing: keep each document of a block apart from the others (positions "
                                          "restart; attention masked; recurrent and convolutional state restarted "
                                          "where the model's layers take seq_idx or cumulative lengths), asked of "
                                          "the model at start-up. auto = where the model can, else documents see "
                                          "each other (said in the setup block); true = refuse a model that cannot; "
                                          "false = every token sees its whole block."})
    data_mixture: str | None = field(
        default=None, metadata={"help": "A YAML file of sources (each with its data options, a weight and a name) "
                                        "drawn by weight; each source's held-out loss is logged apart."})
    sample_message: str = field(
        default="Hello! What can you tell me about yourself?",
        metadata={"help": "Conversations: the user message the end-of-run sample answers (through the chat "
                          "template), instead of continuing --sample_prompt."})

    def check(self):
        import os

        if self.chat_template and not os.path.isfile(self.chat_template):
            raise ConfigError(f"chat template file not found: {self.chat_template}")
        if self.data_mixture:
            from train_extras.data import sources

            given = [f"--{name}" for name in sources.SOURCE_OPTIONS
                     if getattr(self, name) != self.__dataclass_fields__[name].default]
            if given:
                raise ConfigError(f"--data_mixture names its sources' data options itself: not with {', '.join(given)}")
            sources.read(self.data_mixture)
        if self.streaming and (self.data_mixture or self.chat_column or self.chat_template):
            raise ConfigError("--streaming streams text from one source: not with --data_mixture, --chat_column or "
                              "--chat_template")
        if self.packing_strategy != "auto" and not self.packing:
            raise ConfigError(f"--packing_strategy {self.packing_strategy} packs examples: not with --packing false")
        if self.streaming and self.packing_strategy == "best_fit":
            raise ConfigError("--streaming concatenates the stream into blocks: not with --packing_strategy best_fit")


@dataclass
class MixtureOfExpertsOptions:
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={"help": "Mixture-of-experts models: weight of the router's load-balancing loss in the objective "
                          "(default: the model config's router_aux_loss_coef; 0 = off). Refused for a dense model "
                          "and for a router without such a loss (DeepSeek-V3's, GLM-4-MoE's)."})

    def check(self):
        if self.router_aux_loss_coef is not None and self.router_aux_loss_coef < 0:
            raise ConfigError(f"--router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")


@dataclass
class MuonOptions:
    """--optimizer muon (train_extras/muon.py): the hidden matrices' optimizer and its own hyperparameters."""
    optimizer: Literal["adamw", "muon"] = field(
        default="adamw", metadata={"help": "adamw: AdamW on every parameter. muon: torch.optim.Muon on the 2-D "
                                           "weights of the blocks, AdamW (--lr, --weight_decay, the betas) on the "
                                           "embeddings, head, norms and biases; one process or DDP only."})
    muon_lr: float = field(default=0.02, metadata={"help": "Muon's peak learning rate (the schedule scales it as "
                                                           "it scales --lr)."})
    muon_weight_decay: float = field(default=0.1, metadata={"help": "Muon's decoupled weight decay."})
    muon_momentum: float = field(default=0.95, metadata={"help": "Muon's momentum (Nesterov)."})
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = field(
        default="original", metadata={"help": "Muon's per-matrix lr scale: original = sqrt(max(1, rows/cols)); "
                                              "match_rms_adamw = 0.2 sqrt(max(rows, cols)), an update of AdamW's "
                                              "size (then --muon_lr near --lr)."})

    def check(self):
        given = [f"--{name}" for name in ("muon_lr", "muon_weight_decay", "muon_momentum", "muon_adjust_lr")
                 if getattr(self, name) != self.__dataclass_fields__[name].default]
        if self.optimizer != "muon" and given:
            raise ConfigError(f"{', '.join(given)} set Muon's hyperparameters: add --optimizer muon")
        if not self.muon_lr > 0 or self.muon_weight_decay < 0 or not 0 <= self.muon_momentum < 1:
            raise ConfigError("--muon_lr must be > 0, --muon_weight_decay >= 0 and --muon_momentum in [0, 1)")


@dataclass
class LossOptions:
    loss_chunk_size: int = field(
        default=0, metadata={"help": "Compute the output head and the cross-entropy this many tokens at a time "
                                     "(recomputed in backward): the logits of the whole micro-batch over the "
                                     "vocabulary are never held at once. 0 = the plain loss. For large "
                                     "vocabularies: see docs/benchmarks.md for the memory saved."})

    def check(self):
        if self.loss_chunk_size < 0:
            raise ConfigError(f"--loss_chunk_size must be >= 0, got {self.loss_chunk_size}")


@dataclass
class ShardedAccumulationOptions:
    fsdp_sync_each_batch: bool = field(
        default=True, metadata={"help": "FSDP2 with --gradient_accumulation_steps > 1: reduce-scatter the gradients "
                                        "after every micro-batch, so each rank holds a shard's gradient. false: once "
                                        "per step (less communication), holding the whole model's unsharded fp32 "
                                        "gradient between micro-batches."})


@dataclass
class LoraOptions:
    """Low-rank adapters (train_extras/lora.py): the base model frozen, only the adapters trained."""
    lora_r: int = field(
        default=0, metadata={"help": "Train LoRA adapters of this rank on a frozen base model (peft); 0 = train "
                                     "every weight."})
    lora_alpha: float | None = field(
        default=None, metadata={"help": "LoRA's scale numerator (the update is alpha/r * B A); default 2 x "
                                        "--lora_r."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the adapters' input."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Names of the layers to adapt (peft's target_modules); default: every "
                                        "linear layer of the decoder blocks but an MoE router, found from the "
                                        "model."})
    lora_merge: bool = field(
        default=False, metadata={"help": "Also export the base with the adapters merged in, a model "
                                         "from_pretrained loads alone, to <output_dir>/model_merged."})

    def check(self):
        given = [f"--{name}" for name in ("lora_alpha", "lora_dropout", "lora_target_modules", "lora_merge")
                 if getattr(self, name) != self.__dataclass_fields__[name].default]
        if self.lora_r < 0:
            raise ConfigError(f"--lora_r must be >= 0, got {self.lora_r}")
        if self.lora_r == 0 and given:
            raise ConfigError(f"{', '.join(given)} set LoRA's adapters: add --lora_r (their rank)")
        if not 0.0 <= self.lora_dropout < 1.0 or (self.lora_alpha is not None and not self.lora_alpha > 0):
            raise ConfigError("--lora_dropout must be in [0, 1) and --lora_alpha > 0")
        if self.lora_r and importlib.util.find_spec("peft") is None:
            raise ConfigError("--lora_r trains adapters with peft, which is not installed: pip install -e '.[lora]'")
        if self.lora_r and self.optimizer == "muon":
            raise ConfigError("--lora_r with --optimizer muon: Muon orthogonalises whole weight matrices, and a "
                              "LoRA run trains only low-rank factors; use AdamW (the default)")


@dataclass
class TrainConfig(CompileOptions, SampleOptions, TrackingOptions, CheckpointOptions, Fp16Options,
                  AccumulationOptions, ShardedAccumulationOptions, MixtureOfExpertsOptions, LossOptions, MuonOptions,
                  LoraOptions, RecipeConfig,
                  DocumentOptions, DataAtScaleOptions, FineTuneOptions):
    """Every option of train.py: --help lists the groups from the last base to the first."""
    check_order = (FineTuneOptions, DocumentOptions, DataAtScaleOptions, ModelOptions, DataOptions, OptimizerOptions,
                   MuonOptions, LoraOptions, LossOptions, MixtureOfExpertsOptions, AccumulationOptions, Fp16Options,
                   CheckpointOptions, TrackingOptions, SampleOptions)

    def __post_init__(self):
        for name in PATH_OPTIONS:  # before the checks, which look at the files
            value = getattr(self, name)
            setattr(self, name, [os.path.expanduser(v) for v in value] if isinstance(value, list)
                    else value and os.path.expanduser(value))
        super().__post_init__()


# The options that name a file or folder: a leading `~` is the home folder, as the shell makes it, also
# from YAML and from a quoted or `--option=~/x` value (which the shell leaves alone).
PATH_OPTIONS = ("output_dir", "model_name_or_path", "tokenizer_name_or_path", "dataset_name", "data_files",
                "eval_data_files", "resume_from_checkpoint", "chat_template", "data_mixture")
