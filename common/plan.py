"""Memory planner: will my model fit, and with which config?

    python -m common.plan --preset 8b --gpus 8 --gpu_memory_gb 80 --seq_len 4096 --micro_batch_size 1
    python -m common.plan --model_name_or_path path/to/hf_folder --gpus 4 --gpu_memory_gb 40
    python -m common.plan --params 7e9 --gpus 8 --textbook
    python -m common.plan --preset 8b --gpus 1 --gpu_memory_gb 16 --host_memory_gb 64

For every rung of LADDER (cheapest first) it prints the memory per GPU, split into parameters,
gradients, optimizer states (master copies included), framework buffers, activations and logits,
at rest and at peak, and the CPU RAM per process; marks what fits ("tight" when the peak is above
90% of the usable memory); names the cheapest config in accelerate_configs/ that fits with headroom
(the cheapest tight one, with a warning, when only tight ones fit) with its launch line; and when
nothing fits, checks concretely what would (more GPUs, more CPU RAM, activation checkpointing, a
smaller micro-batch, offload) and names those that work. Units: 1 GB = 1e9 bytes.
The presets use the byte tokenizer's 259-token vocabulary (the '8b' preset is 6.98B parameters; a
real Llama-3-8B config, 128k vocabulary, is 8.03B with ~500x larger logits): for a real model pass
--model_name_or_path to a local folder with its config.json. The output says so for presets.

Where the numbers come from
- Model states (`model_state_bytes`): one formula per framework, as configured in this repo, read
  from the installed sources (deepspeed 0.19.8, torch 2.13, accelerate 1.15). Every term is a named
  entry with the file/line that justifies it, so a measurement that disagrees points at one term.
  `--textbook` swaps in the ZeRO paper's numbers (`textbook_bytes`).
- Activations and logits (`activation_bytes`): measured, not taken from GPT constants. One real
  transformers LlamaDecoderLayer of the model's dimensions (sdpa, causal, no mask) runs on the CPU
  at a probe size (batch 1, min(seq_len, 256) tokens); `saved_tensors_hooks` sum the bytes of what
  autograd saves (deduplicated by storage, parameters excluded). The final norm + LM head + fp32
  cross-entropy of `common.model.causal_lm_loss` are probed the same way ("logits"). Results are
  scaled linearly to micro_batch_size x seq_len tokens. ASSUMPTION: attention keeps O(seq) memory
  per layer (SDPA flash / memory-efficient kernels save the output and a log-sum-exp, never the
  T x T scores). True for the GPU kernels and for the CPU flash kernel the probe runs; a math
  fallback (e.g. an explicit attention mask) would add O(seq^2) that this does not show.
  With activation checkpointing the probe wraps the layer in the same non-reentrant checkpoint
  that common/model.py enables and measures what it keeps (the block's input); during backward one
  block's full activations are recomputed, so peak adds one block's measured activations.
  The gradient tensors alive during one block's / the head's backward are measured too (live
  storages, tracked with a dispatch mode) and added as a transient.
  Columns: "activ" = the blocks' saved tensors + one block's backward transient (+ the recomputed
  block); "logits" = the head's saved tensors + the head's backward transient (the logits' fp32
  gradient, tokens x vocab x 4 bytes and its cast: for a large vocabulary it rivals the blocks).
- Peak: the largest of three candidates.
  forward/backward = model states after backward + parameters in flight (FSDP2 all-gathers, ZeRO-3
    fetches, autocast's bf16 weight copies) + backward transients + activations + logits. Within
    the modelled terms this over-counts (activations and gradients both in full, though activations
    are freed while gradients appear; the block's and the head's backward transients together).
  optimizer step = model states after backward + the step's temporaries (DeepSpeed's flattened
    gradient partition and its fp32 copy).
  init = the framework's states at the end of accelerator.prepare (only those that exist then:
    Adam's states are created at the first step, lazily, torch/optim/adam.py _init_group and
    DeepSpeedCPUAdam) + its temporary buffers: ZeRO-1/2's zero fp32 gradient of the master
    partition (stage_1_and_2.py:934-951), ZeRO-3's fp32 gradient buffer of the largest sub-group
    (stage3.py:1301-1306, freed at :1366-1368), FSDP2's one unit moved whole to the GPU before
    fully_shard shards it (_fsdp_init.py:369-401). deepspeed 0.19.8 runs no optimizer step at init
    (older versions did, creating Adam's states there). Read from the code, these init buffers are
    freed before Adam's states, the gradient buffers and (ZeRO-3) the IPG bucket exist, so this
    candidate stays below the other two for every rung: it is modelled and shown ("^"), not a fix.
  NOT AN UPPER BOUND. Measured on CPU (benchmarks/results/memory-2026-11-30: 113.7M parameters,
  2 ranks, bf16, micro-batch 2 x 256) the peak was ABOVE the plan under DeepSpeed: ZeRO-1 +6%,
  ZeRO-2 +8%, ZeRO-3 +22%, ZeRO-3 offload +23% (DDP and FSDP2: 10-14% below). The model states
  at rest agree within 1-5%, so the gap is in transients this does not model; unverified
  candidates: DeepSpeed's communication temporaries (on CPU, gloo's fallbacks for reduce-scatter /
  all-gather), ZeRO-3's fetch/prefetch beyond one module + the prefetch bucket, allocator caching
  and fragmentation (heap, and on a GPU the CUDA caching allocator). Also not modelled: the
  construction transient of zero.Init (one module at a time), ZeRO-1/2 flattening the parameters
  (a second bf16 copy of the model for a moment, on the GPU when it has room, else in CPU RAM:
  stage_1_and_2.py:438-452), torch.compile, the CUDA context itself. Under DeepSpeed treat "tight"
  as "may not fit".
- Fits: peak <= GPU memory - reserve (default 2 GB for the CUDA context, NCCL buffers and
  allocator fragmentation: an allowance, not a measurement), and, with --host_memory_gb, the CPU
  RAM per machine: max(host after backward, host at init) x processes per machine
  (min(--gpus, --gpus_per_node), default min(--gpus, 8)) <= --host_memory_gb. Host at init is the fp32 model
  every process builds on the CPU (recipes/train.py: build_model before accelerator.prepare), 4
  bytes/parameter per process, for every rung but ZeRO-3 with zero3_init_flag (zero.Init builds
  partitions only); for the offload rungs, the parameters/gradients/optimizer states kept in CPU
  RAM. Without --host_memory_gb host RAM is not checked and the output says so (the planner usually
  runs on another machine than the one it plans for, so it does not read this one's /proc/meminfo).
  The OS, the CUDA contexts, pinned data-loader buffers and the page cache are not counted.
- Tight: fits, with the peak above 90% of the usable memory (TIGHT); the recommendation prefers the
  cheapest rung that fits without being tight.
- --textbook: the ZeRO paper's model states. FSDP2 rows are analogies, the paper has no FSDP: no
  reshard ~ ZeRO-2 (2 + 14/W: it holds every parameter gathered from forward to backward, as
  ZeRO-2 holds all bf16 parameters), full shard ~ ZeRO-3 (16/W); between steps FSDP2 here keeps
  12/W (fp32 shards + AdamW), +4/W gradients after backward. Offload rows: ZeRO-3's 16/W in CPU RAM.

Assumptions (each is one named term or one line of code):
- Parameters in flight: FSDP2 full shard holds two blocks (current + prefetched) and the tail unit
  [final norm, lm_head] that accelerate never reshards after forward (with tied embeddings the tail
  is [final norm, embedding = lm_head]: fsdp_utils.py:863-879); without reshard, every unit.
  ZeRO-3 holds the largest module plus stage3_prefetch_bucket_size elements (max_live_parameters
  caps it). DDP/single under autocast keep a bf16 copy of every weight until its backward (measured).
- DeepSpeed bucket sizes come from the JSONs in accelerate_configs/ ("auto" = accelerate's fill).
- gradient_accumulation_steps 1: with accumulation ZeRO-1 keeps full-size gradients between
  micro-batches (+2 bytes/parameter in bf16); not modelled.
- fp16 is probed as bf16 (same sizes); a non-Llama config is probed as a Llama block of its dims.

Exit codes: 0 when the plan is printed, whether or not something fits (a line "fits: ..." followed
by the launch line, or a last line "nothing fits: ..."); 2 on bad input (including a number that is
inf or nan), with one line "error: ..." on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass

GB = 1e9
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "accelerate_configs")
PROBE_TOKENS = 256  # tokens per block probe (batch 1); fewer when seq_len is shorter
CKPT_PROBE_TOKENS = 32  # a checkpointed block keeps only its input: a small probe suffices
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
MAX_GPUS = 4096  # search limit for "more GPUs"


class PlanError(ValueError):
    """Bad input: printed as one `error:` line, exit code 2."""


@dataclass(frozen=True)
class Rung:
    name: str  # short name (tables, tests)
    config: str  # file in accelerate_configs/
    framework: str  # "single" | "ddp" | "deepspeed" | "fsdp"
    stage: int = 0  # ZeRO stage (DeepSpeed only)
    reshard: bool = True  # FSDP2 reshard_after_forward
    offload: bool = False  # parameters + optimizer state in CPU RAM
    label: str = ""


# Cheapest first: least communication and overhead. Tests and benchmarks iterate over this.
LADDER: tuple[Rung, ...] = (
    Rung("ddp", "ddp.yaml", "ddp", label="DDP"),
    Rung("zero1", "deepspeed_zero1.yaml", "deepspeed", stage=1, label="ZeRO-1"),
    Rung("zero2", "deepspeed_zero2.yaml", "deepspeed", stage=2, label="ZeRO-2"),
    Rung("fsdp_shard_grad_op", "fsdp_shard_grad_op.yaml", "fsdp", reshard=False, label="FSDP2 no reshard"),
    Rung("fsdp", "fsdp.yaml", "fsdp", label="FSDP2 full shard"),
    Rung("zero3", "deepspeed_zero3.yaml", "deepspeed", stage=3, label="ZeRO-3"),
    Rung("fsdp_offload", "fsdp_offload.yaml", "fsdp", offload=True, label="FSDP2 + offload"),
    Rung("zero3_offload", "deepspeed_zero3_offload.yaml", "deepspeed", stage=3, offload=True, label="ZeRO-3 + offload"),
)
SINGLE = Rung("single", "single_gpu.yaml", "single", label="single GPU")
RUNGS = {r.name: r for r in (SINGLE,) + LADDER} | {r.config: r for r in (SINGLE,) + LADDER}


def ladder(gpus: int) -> tuple[Rung, ...]:
    """The rungs for this GPU count: with one GPU the first rung is a plain single-GPU run."""
    return ((SINGLE,) + LADDER[1:]) if gpus == 1 else LADDER


def get_rung(rung: Rung | str) -> Rung:
    if isinstance(rung, Rung):
        return rung
    if rung not in RUNGS:
        raise PlanError(f"unknown rung {rung!r}; choose one of {', '.join(r.name for r in (SINGLE,) + LADDER)}")
    return RUNGS[rung]


# --------------------------------------------------------------------------------------------
# Model shape (meta device: no memory, no download)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    name: str  # "preset '8b'" or the folder
    n_params: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int | None
    rms_eps: float
    block_params: int  # one decoder block: an FSDP2 unit
    embed_params: int  # input embedding (an FSDP2 unit of its own when untied; in the tail when tied)
    # accelerate's FSDP2 tail unit, reshard_after_forward=False: final norm + lm_head, and with tied
    # weights the shared embedding/lm_head (accelerate/utils/fsdp_utils.py:863-879)
    tail_params: int
    largest_module_params: int  # ZeRO-3 gathers per submodule (its direct parameters)
    param_numels: tuple[int, ...]  # every parameter tensor (ZeRO-3 persistence threshold)
    llama: bool  # False: the activation probe uses a Llama block of the same dimensions
    tied: bool = False  # input embedding and lm_head share one weight (tie_word_embeddings)
    preset: str | None = None  # the preset's name (byte vocabulary); None for a folder

    @property
    def dims(self) -> tuple:
        return (self.hidden, self.intermediate, self.heads, self.kv_heads, self.head_dim, self.vocab, self.rms_eps)


def load_config(preset: str | None = None, model_name_or_path: str | None = None):
    """The transformers config: a preset (byte vocabulary, 259) or a local folder's config.json."""
    from common.config import PRESET_NAMES, TrainConfig
    from common.model import model_config

    if model_name_or_path is not None:
        if not os.path.isdir(model_name_or_path):
            raise PlanError(f"--model_name_or_path {model_name_or_path}: no such folder (the planner reads a local "
                            "config.json and downloads nothing)")
        if not os.path.isfile(os.path.join(model_name_or_path, "config.json")):
            raise PlanError(f"--model_name_or_path {model_name_or_path}: no config.json in that folder")
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(model_name_or_path)
        except (OSError, ValueError, KeyError) as err:
            raise PlanError(f"cannot read {model_name_or_path}/config.json: {str(err).splitlines()[0]}")
    if preset not in PRESET_NAMES:
        raise PlanError(f"unknown preset {preset!r}; choose one of {', '.join(PRESET_NAMES)}")
    return model_config(TrainConfig(preset=preset), vocab_size=259)


@functools.lru_cache(maxsize=8)
def model_shape(preset: str | None = None, model_name_or_path: str | None = None) -> ModelShape:
    """Parameter counts and dimensions, from the real model class built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    config = load_config(preset, model_name_or_path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as err:
        raise PlanError(f"cannot build a causal LM from that config: {str(err).splitlines()[0]}")
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise PlanError(f"cannot find the transformer blocks ({sorted(block_names)}) of {type(model).__name__}")
    numel = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
    n_params = numel(model)  # parameters() deduplicates tied weights
    embed = model.get_input_embeddings()
    embed_params = numel(embed)
    head = model.get_output_embeddings()
    tied = getattr(head, "weight", None) is not None and head.weight is getattr(embed, "weight", None)
    try:
        heads = text.num_attention_heads
        return ModelShape(
            name=f"preset {preset!r}" if model_name_or_path is None else model_name_or_path,
            n_params=n_params,
            layers=len(blocks),
            hidden=text.hidden_size,
            intermediate=text.intermediate_size,
            heads=heads,
            kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            vocab=text.vocab_size,
            max_positions=getattr(text, "max_position_embeddings", None),
            rms_eps=float(getattr(text, "rms_norm_eps", 1e-5)),
            block_params=max(numel(b) for b in blocks),
            embed_params=embed_params,
            # Untied: [final norm, lm_head]; the embedding is a unit of its own. Tied: accelerate puts
            # the shared embedding/lm_head into the tail with the final norm (fsdp_utils.py:873-874).
            tail_params=n_params - sum(numel(b) for b in blocks) - (0 if tied else embed_params),
            largest_module_params=max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
            param_numels=tuple(p.numel() for p in model.parameters()),
            llama=getattr(text, "model_type", "") == "llama",
            tied=tied,
            preset=preset if model_name_or_path is None else None,
        )
    except AttributeError as err:  # the probe needs a Llama-like decoder's fields
        raise PlanError(f"{model_name_or_path}: not a Llama-like decoder config ({err})")


# --------------------------------------------------------------------------------------------
# Model states
# --------------------------------------------------------------------------------------------

# When a term is present. "rest": between steps (after zero_grad(set_to_none=True)) and also at the
# step. "step": after backward until the step's zero_grad (gradients). The transients, on the GPU:
# "in_flight": unsharded/fetched parameters held during forward/backward; "backward": buffers alive
# only during backward; "optimizer_step": temporaries inside optimizer.step(). "init": alive only
# while the run starts, at one of two moments (the term's "moment"): "build" (build_model makes the
# model, before accelerator.prepare) and "setup" (inside accelerator.prepare, once the framework's
# states exist; a "rest" term with at_init=True is already there then, the others are created later,
# e.g. Adam's states at the first optimizer.step()).
WHEN = ("rest", "step", "in_flight", "backward", "optimizer_step", "init")
TRANSIENTS = ("in_flight", "backward", "optimizer_step")
INIT_MOMENTS = ("build", "setup")
CATEGORIES = ("params", "grads", "optimizer", "buffers")

SRC_DS12 = "deepspeed/runtime/zero/stage_1_and_2.py"
SRC_DS3 = "deepspeed/runtime/zero/stage3.py"
SRC_FSDP = "torch/distributed/fsdp/_fully_shard"
SRC_BUILD = "recipes/train.py:123 (common.model.build_model: from_config / from_pretrained in fp32 on the CPU)"
SRC_ADAM_LAZY = "torch/optim/adam.py:139-187 (_init_group: exp_avg/exp_avg_sq created at the first step)"


@functools.lru_cache(maxsize=16)
def zero3_init(config: str) -> bool:
    """Whether a DeepSpeed config in accelerate_configs/ builds the model inside deepspeed.zero.Init
    (zero3_init_flag: each rank materialises only its partitions; accelerate's default is False)."""
    import yaml

    path = os.path.join(CONFIG_DIR, config)
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        ds = (yaml.safe_load(f) or {}).get("deepspeed_config") or {}
    return bool(ds.get("zero3_init_flag", False))


@functools.lru_cache(maxsize=64)
def zero_settings(config: str, hidden: int | None = None) -> dict:
    """ZeRO buffer sizes (elements) as DeepSpeed will see them for a config in accelerate_configs/.

    Read from the config's deepspeed_config_file JSON when there is one; "auto" is what accelerate
    fills in from the model's hidden size (accelerate/accelerator.py:2321-2326): reduce bucket
    h*h, ZeRO-3 prefetch bucket 0.9*h*h, persistence threshold 10*h (None when h is unknown).
    Missing keys (and inline configs without a JSON) take DeepSpeed's defaults
    (deepspeed/runtime/zero/config.py:102-245, overlap_comm default True for stage 3 only: :384-386).
    """
    import yaml

    zero = {}
    path = os.path.join(CONFIG_DIR, config)
    if os.path.isfile(path):
        with open(path) as f:
            ds = (yaml.safe_load(f) or {}).get("deepspeed_config") or {}
        json_file = ds.get("deepspeed_config_file")
        if json_file:
            json_path = json_file if os.path.isabs(json_file) else os.path.join(os.path.dirname(CONFIG_DIR), json_file)
            with open(json_path) as f:
                zero = json.load(f).get("zero_optimization", {})
    stage = int(zero.get("stage", 3 if "zero3" in config else 2 if "zero2" in config else 1))
    h2 = hidden * hidden if hidden else None
    auto = {"reduce_bucket_size": h2, "stage3_prefetch_bucket_size": 0.9 * h2 if h2 else None,
            "stage3_param_persistence_threshold": 10 * hidden if hidden else None}
    defaults = {"reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7,
                "stage3_param_persistence_threshold": 1e5, "stage3_max_live_parameters": 1e9,
                "sub_group_size": 1e9, "overlap_comm": stage == 3, "contiguous_gradients": True}
    out = {"stage": stage}
    for key, default in defaults.items():
        value = zero.get(key, default)
        out[key] = auto.get(key) if value == "auto" else value
    return out


def textbook_bytes(rung: Rung | str, n_params: float, world_size: int) -> dict:
    """The ZeRO paper's model states (Rajbhandari et al. 2020, fig. 1): fp16 mixed precision with
    Adam, K = 12 bytes/parameter of optimizer state. Per GPU: DDP 16 bytes/parameter, ZeRO-1
    4 + 12/W, ZeRO-2 2 + 14/W, ZeRO-3 16/W. The paper has no FSDP: as an analogy FSDP2 without
    reshard gets ZeRO-2's numbers (at its peak it holds every parameter gathered, as ZeRO-2 holds
    all of them; between steps FSDP2 here keeps only 12/W) and full shard ZeRO-3's; the offload
    rungs move ZeRO-3's 16/W to CPU RAM (the paper has no figure for them)."""
    return model_state_bytes(rung, n_params, world_size, textbook=True)


def model_state_bytes(rung: Rung | str, n_params: float, world_size: int, precision: str = "bf16",
                      shape: ModelShape | None = None, textbook: bool = False) -> dict:
    """Bytes PER RANK of parameters, gradients, optimizer states and framework buffers, as the
    framework of `rung` keeps them in this repo (model built in fp32; torch AdamW, DeepSpeedCPUAdam
    under ZeRO-3 offload; accelerate defaults; the DeepSpeed JSONs in accelerate_configs/).

    precision: "bf16" | "fp16" | "fp32" (accelerate mixed_precision "no").
    shape: the model's dimensions; without it, terms that need them (bucket sizes, blocks in
    flight) are left out and named in "unknown".

    Returns a dict:
      rung, config, world_size, precision, n_params, textbook
      terms: list of {name, category (params|grads|optimizer|buffers), location (device|host),
             when (rest|step|in_flight|backward|optimizer_step|init), bytes, source, at_init (a "rest"
             term that already exists at the "setup" moment of initialisation), moment (init terms:
             build|setup)}
      at_rest: {"device": {params, grads, optimizer, buffers, total}, "host": {...}}
               between steps, after optimizer.zero_grad(set_to_none=True)
      at_step: same keys: model states after backward, before optimizer.step() (gradients present)
      transient: {in_flight, backward, optimizer_step}: extra GPU bytes during forward/backward
               (unsharded or fetched parameters), during backward only, inside optimizer.step()
      at_init: same keys as at_rest: the larger, per location, of the two moments of initialisation
               ("build": the fp32 model on the CPU; "setup": the framework's states created by
               accelerator.prepare plus its temporary buffers). Empty with textbook=True.
      unknown: names of terms left out for want of `shape`
    """
    rung = get_rung(rung)
    if precision not in DTYPE_BYTES:
        raise PlanError(f"unknown precision {precision!r}; choose one of bf16, fp16, fp32")
    if world_size < 1:
        raise PlanError(f"world size must be >= 1, got {world_size}")
    P, W = float(n_params), world_size
    b = DTYPE_BYTES[precision]  # compute dtype: autocast target, FSDP2 param_dtype, DeepSpeed model dtype
    terms, unknown = [], []

    def add(name, category, when, nbytes, source, location="device", at_init=False, moment=None):
        terms.append(dict(name=name, category=category, location=location, when=when, bytes=float(nbytes),
                          source=source, at_init=at_init, moment=moment))

    def add_build():
        """Every rung but ZeRO-3 with zero3_init_flag: each process builds the whole model in fp32 in
        CPU RAM before accelerator.prepare moves/casts/shards it."""
        add("fp32 model built in CPU RAM by every process (before accelerator.prepare)", "params", "init", 4 * P,
            SRC_BUILD, "host", moment="build")

    if textbook:
        host = "host" if rung.offload else "device"
        # ZeRO paper partitioning: stage 1 the optimizer states, 2 + gradients, 3 + parameters.
        stage = {"single": 0, "ddp": 0, "deepspeed": rung.stage, "fsdp": 2 if not rung.reshard else 3}[rung.framework]
        add("fp16 parameters (2 bytes)", "params", "rest", 2 * P / (W if stage >= 3 else 1), "ZeRO paper", host)
        add("fp16 gradients (2 bytes)", "grads", "step", 2 * P / (W if stage >= 2 else 1), "ZeRO paper", host)
        add("fp32 master + Adam m + v (K = 12 bytes)", "optimizer", "rest", 12 * P / (W if stage >= 1 else 1),
            "ZeRO paper", host)
    elif rung.framework in ("single", "ddp"):
        # accelerate's mixed precision for DDP/single is autocast: the weights stay fp32.
        add("fp32 parameters", "params", "rest", 4 * P,
            "common/model.py build_model (fp32); accelerate/accelerator.py:1824-1835 (autocast wraps forward)",
            at_init=True)
        add("AdamW exp_avg + exp_avg_sq, fp32", "optimizer", "rest", 8 * P,
            "torch/optim/adam.py _init_group: zeros_like(param) for both states")
        add_build()
        add("fp32 gradients (.grad)", "grads", "step", 4 * P,
            "autograd accumulates in the parameter dtype; zero_grad(set_to_none=True) frees them")
        if rung.framework == "ddp":
            add("DDP reducer buckets (a second fp32 copy of every gradient)", "buffers", "rest", 4 * P,
                "torch/nn/parallel/distributed.py:731-735 (gradient_as_bucket_view=False saves nothing); "
                "accelerate/utils/dataclasses.py:188 (accelerate's default: False)", at_init=True)
    elif rung.framework == "deepspeed" and rung.stage in (1, 2):
        # DeepSpeed casts the module to bf16/fp16 (fp32 for mixed_precision "no") and takes the
        # DeepSpeedZeroOptimizer path: bf16 + stage 1 only switches to BF16_Optimizer when
        # data_types.grad_accum_dtype is fp32 (engine.py:2305-2311, 1806-1807); the JSONs set none.
        ds = zero_settings(rung.config, shape.hidden if shape else None)
        add(f"{precision} parameters, one flat buffer (bit16_groups_flat; model params are views)", "params",
            "rest", b * P, f"{SRC_DS12}:509-524, 534 (_update_model_bit16_weights)", at_init=True)
        add("fp32 master partition (single_partition_of_fp32_groups; a copy even in fp32 training)",
            "optimizer", "rest", 4 * P / W, f"{SRC_DS12}:560-577 (.clone().to(fp32))", at_init=True)
        add("AdamW exp_avg + exp_avg_sq on the fp32 partition", "optimizer", "rest", 8 * P / W,
            f"{SRC_DS12}:584 (the optimizer sees only the fp32 partition); {SRC_ADAM_LAZY}")
        add_build()
        # initialize_optimizer_states: a zero fp32 gradient for the master partition, dropped again at
        # its end without CPU offload. deepspeed 0.19.8 runs no optimizer step here (older versions
        # did, creating Adam's states at init): they appear at the first real step.
        add("zero fp32 gradient of the master partition (initialize_optimizer_states; freed at its end)", "grads",
            "init", 4 * P / W, f"{SRC_DS12}:934-951 (called at :734)", moment="setup")
        add(f"gradient partition, {precision} (grads_in_partition)", "grads", "step", b * P / W,
            f"{SRC_DS12}:2184-2199 (contiguous_gradients), kept by averaged_gradients until step()")
        n_buckets = 2 if ds["overlap_comm"] else 1
        if ds["reduce_bucket_size"] is None:
            unknown.append("IPG buckets (reduce_bucket_size: auto = hidden^2)")
        else:
            add(f"{n_buckets} IPG bucket(s) of reduce_bucket_size={ds['reduce_bucket_size']:.3g} elements", "buffers",
                "backward", n_buckets * ds["reduce_bucket_size"] * b,
                f"{SRC_DS12}:3256-3279 (setup_buckets), freed at the end of backward (:924-931)")
        if rung.stage == 1 and not ds["overlap_comm"]:
            # Without overlap_comm ZeRO-1 reduces once, after backward (:2284-2295, :966-983):
            # every rank holds all gradients until then.
            add("full-size gradients until the end-of-backward reduction", "grads", "backward", b * P * (1 - 1 / W),
                f"{SRC_DS12}:2284-2295")
        elif rung.stage == 1 and ds["reduce_bucket_size"] is not None and shape is not None:
            # With overlap_comm gradients are reduced through the buckets as they arrive, but a
            # parameter larger than a bucket keeps its own gradient (:1443-1449), and ZeRO-1 frees
            # the other ranks' ones only at the end of backward (:2271-2273; ZeRO-2 at once, :2262-2268).
            # Measured (small preset, fp32, 2 CPU ranks): +1.15/+1.49 bytes/param over ZeRO-2.
            large = sum(n for n in shape.param_numels if n > ds["reduce_bucket_size"])
            add("gradients of parameters larger than a bucket, kept until the end of backward", "grads", "backward",
                b * large * (1 - 1 / W), f"{SRC_DS12}:1443-1449, 2271-2273")
        elif rung.stage == 1:
            unknown.append("ZeRO-1 gradients of parameters larger than a bucket")
        # step(): flatten the partition's gradients (a copy) and cast it to fp32 (another copy
        # unless already fp32); both alive at the cast.
        add("flattened gradient partition + its fp32 copy inside step()", "grads", "optimizer_step",
            (b + 4) * P / W if b != 4 else 4 * P / W, f"{SRC_DS12}:3108-3126")
    elif rung.framework == "deepspeed":  # ZeRO-3
        ds = zero_settings(rung.config, shape.hidden if shape else None)
        off = "host" if rung.offload else "device"
        add(f"{precision} parameter partitions", "params", "rest", b * P / W,
            f"{SRC_DS3}:968-973 (lp_param_buffer); offload_param: pinned CPU buffer :977-998, :888-911", off,
            at_init=True)
        # Always a separate copy, even in fp32: the reuse branch (:1162-1167) compares the partition's
        # torch.device with the device *name* string (self.device, :333), which is never equal.
        # Measured (small preset, fp32, 2 CPU ranks): 10.34 bytes/param at rest = 20.7/W.
        add("fp32 master partition (a copy, even in fp32 training)", "optimizer", "rest", 4 * P / W,
            f"{SRC_DS3}:1156-1160, 1168-1172 (.clone())", off, at_init=True)
        add("Adam exp_avg + exp_avg_sq, fp32" + (" (DeepSpeedCPUAdam)" if rung.offload else ""), "optimizer", "rest",
            8 * P / W, "deepspeed/ops/adam/cpu_adam.py:158-164 (created at the first step)" if rung.offload
            else f"torch AdamW on the fp32 partition; {SRC_ADAM_LAZY}", off)
        add(f"gradient partitions, {precision} (grad_partitions_flat_buffer, allocated once)", "grads", "rest",
            b * P / W, f"{SRC_DS3}:789-795 (on self.device: the CPU with optimizer offload, :333; allocated after "
                       "initialize_optimizer_states, :772)", off)
        if rung.offload:
            add("fp32 gradient buffer of the CPU optimizer (pinned)", "grads", "rest", 4 * P / W,
                f"{SRC_DS3}:1337-1342", "host", at_init=True)
        else:
            # step(): flatten (copy) + cast to fp32 per sub-group (sub_group_size elements at most).
            part = min(P / W, ds["sub_group_size"])
            add("flattened gradient partition + its fp32 copy inside step()", "grads", "optimizer_step",
                (b + 4) * part if b != 4 else 4 * part, f"{SRC_DS3}:2683-2694")
        # initialize_optimizer_states: an fp32 gradient buffer of the largest sub-group's partition on
        # self.device (the CPU with optimizer offload), dropped at its end (without offload the
        # sub-groups' .grad are reset to None, :1366-1368); no optimizer step in deepspeed 0.19.8.
        add("fp32 gradient buffer of the largest sub-group (initialize_optimizer_states; freed at its end)", "grads",
            "init", 4 * min(P / W, ds["sub_group_size"]), f"{SRC_DS3}:1301-1306 (called at :772)", off,
            moment="setup")
        if not zero3_init(rung.config):
            add_build()
        if shape is None or ds["reduce_bucket_size"] is None:
            unknown += ["IPG bucket", "persistent small parameters", "fetched parameters", "module gradient"]
        else:
            add(f"IPG bucket of reduce_bucket_size={ds['reduce_bucket_size']:.3g} elements (allocated at init)",
                "buffers", "rest", ds["reduce_bucket_size"] * b, f"{SRC_DS3}:779-784")
            threshold = ds["stage3_param_persistence_threshold"]
            persistent = sum(n for n in shape.param_numels if n <= threshold)
            add(f"persistent parameters (<= {threshold:.3g} elements, whole on every rank)", "params", "rest",
                b * persistent, "deepspeed/runtime/zero/partition_parameters.py:1292-1293 (ds_persist)", at_init=True)
            fetched = min(shape.largest_module_params + ds["stage3_prefetch_bucket_size"],
                          max(ds["stage3_max_live_parameters"], shape.largest_module_params))
            add("fetched parameters: the largest module + the prefetch bucket (assumed)", "params", "in_flight",
                b * fetched, "deepspeed/runtime/zero/partitioned_param_coordinator.py:310-460 (fetch_sub_module, "
                             "prefetch up to stage3_prefetch_bucket_size, max_live_parameters)")
            add("one module's full gradient before its reduce-scatter", "grads", "backward",
                b * max(shape.param_numels), f"{SRC_DS3}:2006-2050 (partition_grads)")
    else:  # FSDP2
        off = "host" if rung.offload else "device"
        # The model is built in fp32; MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
        # (common/strategy.py) only changes the all-gathered copies: shards, their grads and the
        # AdamW states stay fp32. CPUOffloadPolicy keeps all three in CPU RAM.
        add("fp32 parameter shards (DTensor)", "params", "rest", 4 * P / W,
            f"{SRC_FSDP}/_fsdp_param.py:298-318 (padded shard in the original dtype; offload: .cpu())", off,
            at_init=True)
        add("AdamW exp_avg + exp_avg_sq on the shards", "optimizer", "rest", 8 * P / W,
            f"{SRC_ADAM_LAZY} (states on the shard's device)", off)
        add_build()
        add("fp32 gradient shards", "grads", "step", 4 * P / W,
            f"{SRC_FSDP}/_fsdp_collectives.py:686-710 (views of the fp32 reduce-scatter output; offload: copied to CPU)",
            off)
        if shape is None:
            unknown += ["unsharded parameters in flight", "unsharded gradients + reduce-scatter input",
                        "one unit's parameters moved whole to the GPU at init"]
        else:
            if rung.reshard:
                # Current block + the prefetched one, plus the tail unit [final norm, lm_head] (with
                # tied weights [final norm, embedding = lm_head]) that accelerate shards with
                # reshard_after_forward=False: unsharded from the end of forward to the start of
                # backward, the peak moment.
                in_flight = 2 * shape.block_params + shape.tail_params
                why = ("two blocks (current + prefetched) + the tail [final norm, "
                       + ("tied embedding/lm_head]" if shape.tied else "lm_head]"))
            else:
                in_flight = shape.n_params  # every unit stays gathered from its forward to its backward
                why = "every unit, held from its forward to its backward"
            add(f"all-gathered parameters in {precision}: {why}", "params", "in_flight", b * in_flight,
                f"{SRC_FSDP}/_fsdp_param.py:630-680 (unsharded params), accelerate/utils/fsdp_utils.py:857-878")
            unit = max(shape.block_params, shape.tail_params, 0 if shape.tied else shape.embed_params)
            add(f"one unit's unsharded {precision} gradients + fp32 reduce-scatter input", "grads", "backward",
                (b + 4) * unit, f"{SRC_FSDP}/_fsdp_collectives.py:592-605")
            # fully_shard moves each unit's fp32 parameters to the GPU whole, then shards them.
            add("one unit's fp32 parameters, moved to the GPU whole by fully_shard before it shards them", "params",
                "init", 4 * unit, f"{SRC_FSDP}/_fsdp_init.py:369-401, 567 (_move_states_to_device)",
                moment="setup")

    def total(whens, location, keep=lambda t: True):
        sums = {c: sum(t["bytes"] for t in terms if t["category"] == c and t["when"] in whens
                       and t["location"] == location and keep(t)) for c in CATEGORIES}
        return sums | {"total": sum(sums.values())}

    def at_init(location):
        build = total(("init",), location, lambda t: t["moment"] == "build")
        setup = total(("rest", "init"), location, lambda t: t["at_init"] if t["when"] == "rest"
                      else t["moment"] == "setup")
        return max(build, setup, key=lambda d: d["total"])

    return dict(
        rung=rung.name, config=rung.config, world_size=W, precision=precision, n_params=P, textbook=textbook,
        terms=terms, unknown=unknown,
        at_rest={loc: total(("rest",), loc) for loc in ("device", "host")},
        at_step={loc: total(("rest", "step"), loc) for loc in ("device", "host")},
        transient={w: sum(t["bytes"] for t in terms if t["when"] == w) for w in TRANSIENTS},
        at_init={loc: at_init(loc) for loc in ("device", "host")},
    )


# --------------------------------------------------------------------------------------------
# Activations and logits: measured on the CPU
# --------------------------------------------------------------------------------------------

def _param_copy(t, params: dict) -> bool:
    """True if `t` is a copy of a parameter (autocast's bf16 weight, or a view of it): same number
    of elements, reached through single-input autograd nodes (cast, transpose) from the parameter's
    AccumulateGrad. An embedding lookup also has a single parent, but not the weight's size."""
    fn = t.grad_fn
    for _ in range(6):
        if fn is None:
            return False
        if hasattr(fn, "variable"):
            return id(fn.variable) in params and params[id(fn.variable)] == t.numel()
        parents = [f for f, _ in fn.next_functions if f is not None]
        if len(parents) != 1:
            return False
        fn = parents[0]
    return False


class SavedBytes:
    """Context manager: sums the bytes of the tensors autograd saves for backward, once per storage,
    leaving out parameters and the storages in `exclude`. `.saved`: activations; `.copies`:
    tensors derived from parameters alone (autocast's low-precision weight copies)."""

    def __init__(self, params=(), exclude=()):
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._param_ids = {id(p): p.numel() for p in params}
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._saved, self._copies = {}, {}

    def _pack(self, t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self._params and key not in self._exclude:
            (self._copies if _param_copy(t, self._param_ids) else self._saved)[key] = storage.nbytes()
        return t  # keeps the tensor alive, so data_ptr keys cannot be reused during the forward

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def saved(self) -> int:
        return sum(self._saved.values())

    @property
    def copies(self) -> int:
        return sum(self._copies.values())


def live_tracker(exclude=()):
    """A dispatch mode that records every storage ops return (weak references) and the peak of the
    bytes still alive: what gradients and temporaries cost while backward runs. Storages of the
    tensors in `exclude` (parameters: an op returning a view of a weight would add it) are left out."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    import torch

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.refs, self.peak = {}, 0
            self.exclude = {StorageWeakRef(t.untyped_storage()).cdata for t in exclude}

        def live(self) -> int:
            self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
            return sum(n for _, n in self.refs.values())

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    ref = StorageWeakRef(storage)
                    if ref.cdata in self.exclude:
                        continue
                    if ref.cdata not in self.refs or self.refs[ref.cdata][0].expired():
                        self.refs[ref.cdata] = (ref, storage.nbytes())
            self.peak = max(self.peak, self.live())
            return out

    return LiveBytes()


def _probe_config(dims: tuple):
    from transformers import LlamaConfig

    hidden, intermediate, heads, kv_heads, head_dim, vocab, eps = dims
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab, rms_norm_eps=eps,
                         num_hidden_layers=1, max_position_embeddings=max(PROBE_TOKENS, 1), attention_bias=False,
                         mlp_bias=False, tie_word_embeddings=False, use_cache=False)
    config._attn_implementation = "sdpa"
    return config


def _regime(regime: str):
    """(parameter dtype, residual-stream dtype, autocast dtype or None) of a regime:
    "fp32"; "autocast" (fp32 weights under bf16 autocast: accelerate's DDP/single);
    "low" (bf16 weights and activations: DeepSpeed's bf16 module, FSDP2's bf16 unsharded params).
    fp16 is probed as bf16: same element size, same ops, and the CPU runs bf16 reliably."""
    import torch

    return {"fp32": (torch.float32, torch.float32, None),
            "autocast": (torch.float32, torch.float32, torch.bfloat16),
            "low": (torch.bfloat16, torch.bfloat16, None)}[regime]


def _zeroed(module, dtype):
    """Materialise a meta-built module on the CPU with zeros (values do not change what autograd
    saves; zeros are instant where random init of a 7B-shaped block takes seconds)."""
    import torch

    module = module.to(dtype).to_empty(device="cpu")
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            t.zero_()
    return module


@functools.lru_cache(maxsize=32)
def probe_block(dims: tuple, regime: str, tokens: int) -> dict:
    """Bytes one decoder block keeps for backward at `tokens` tokens (batch 1), measured.

    Returns {saved, copies, rope, checkpointed, backward_extra, tokens, ckpt_tokens, seconds}:
    saved = activations autograd keeps (rotary cos/sin left out: the model shares them between
    blocks, counted once as `rope`); copies = autocast weight copies it keeps; checkpointed = what
    the block keeps under non-reentrant checkpointing (at ckpt_tokens); backward_extra = peak bytes
    of gradients/temporaries on top of the saved ones while the block runs backward.
    """
    import torch
    from torch.utils.checkpoint import checkpoint
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    start = time.perf_counter()
    param_dtype, act_dtype, autocast = _regime(regime)
    config = _probe_config(dims)
    with torch.device("meta"):
        layer = LlamaDecoderLayer(config, layer_idx=0)
    layer = _zeroed(layer, param_dtype).train()
    rope = LlamaRotaryEmbedding(config)
    params = list(layer.parameters())
    amp = (lambda: torch.autocast("cpu", dtype=autocast)) if autocast else contextlib.nullcontext

    def run(n, ckpt=False):
        x = torch.zeros(1, n, dims[0], dtype=act_dtype, requires_grad=True)
        position_ids = torch.arange(n)[None]
        cos, sin = rope(x, position_ids)
        fn = lambda h: layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=(cos, sin))  # noqa
        return x, (cos, sin), (lambda h: checkpoint(fn, h, use_reentrant=False)) if ckpt else fn

    with torch.enable_grad():
        x, rope_t, fn = run(tokens)
        tracker = live_tracker(params)
        with tracker, SavedBytes(params, exclude=rope_t) as counted, amp():
            out = fn(x)
            out = out[0] if isinstance(out, tuple) else out
        base = tracker.live()
        with tracker:  # gradients w.r.t. the input only: weight gradients are model states
            torch.autograd.grad(out, x, torch.ones_like(out))
        backward_extra = max(0, tracker.peak - base)
        del out
        ckpt_tokens = min(tokens, CKPT_PROBE_TOKENS)
        xc, _, fnc = run(ckpt_tokens, ckpt=True)
        with SavedBytes(params) as kept, amp():
            outc = fnc(xc)
        del outc
    return dict(saved=counted.saved, copies=counted.copies, rope=sum(t.untyped_storage().nbytes() for t in rope_t),
                checkpointed=kept.saved, backward_extra=backward_extra, tokens=tokens, ckpt_tokens=ckpt_tokens,
                seconds=time.perf_counter() - start)


@functools.lru_cache(maxsize=32)
def probe_head(dims: tuple, regime: str, tokens: int) -> dict:
    """Bytes the embedding lookup, final RMSNorm, lm_head and fp32 cross-entropy of
    common.model.causal_lm_loss keep for backward (the "logits" bucket), measured at `tokens`.
    Returns {saved, copies, backward_extra, tokens, seconds}; backward_extra = peak bytes of the
    logits' gradients/temporaries on top of the saved ones (forward upcast and backward)."""
    import torch
    from torch import nn
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    start = time.perf_counter()
    param_dtype, _, autocast = _regime(regime)
    hidden, vocab, eps = dims[0], dims[5], dims[6]
    with torch.device("meta"):
        embed, norm, head = nn.Embedding(vocab, hidden), LlamaRMSNorm(hidden, eps=eps), nn.Linear(hidden, vocab, False)
    embed, norm, head = (_zeroed(m, param_dtype) for m in (embed, norm, head))
    params = [p for m in (embed, norm, head) for p in m.parameters()]
    amp = (lambda: torch.autocast("cpu", dtype=autocast)) if autocast else contextlib.nullcontext
    ids = torch.zeros(1, tokens, dtype=torch.long)
    with torch.enable_grad():
        tracker = live_tracker(params)
        with tracker, SavedBytes(params) as counted:
            with amp():
                h = embed(ids)
                logits = head(norm(h))
            # causal_lm_loss: logits upcast to fp32 outside autocast (accelerate's
            # convert_outputs_to_fp32 does the same), then cross-entropy.
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, vocab), ids.reshape(-1))
            del logits
        base = tracker.live()
        with tracker:
            torch.autograd.grad(loss, h)
    return dict(saved=counted.saved, copies=counted.copies, backward_extra=max(0, tracker.peak - base),
                tokens=tokens, seconds=time.perf_counter() - start)


def activation_bytes(shape: ModelShape, regime: str, seq_len: int, micro_batch_size: int,
                     activation_checkpointing: bool = False) -> dict:
    """Activation memory per GPU for micro_batch_size x seq_len tokens, from the CPU probes scaled
    linearly (see the module docstring for the O(seq) assumption).

    Returns {activations, blocks, recompute, rope, logits, weight_copies, backward, backward_block,
    backward_head, tokens, probe}:
      activations = blocks + recompute + rope
      blocks: what L blocks keep from forward to backward (their saved tensors; with checkpointing
              their inputs only)
      recompute: with checkpointing, one block's full activations, recomputed during its backward
      rope: rotary cos/sin, computed once per forward and shared by the blocks
      logits: what the embedding/final norm/lm_head/cross-entropy keep (fp32 log-probs dominate)
      weight_copies: autocast's low-precision weight copies kept for backward (L blocks' + lm_head;
                   one block's + lm_head's with checkpointing)
      backward = backward_block + backward_head (both added although they are never alive together)
      backward_block: gradients and temporaries alive during the backward of one block
      backward_head: the same for the head: the logits' gradient (fp32, tokens x vocab, and its cast
                back to the compute dtype) dominates; large for a large vocabulary
    """
    tokens = micro_batch_size * seq_len
    probe_tokens = min(seq_len, PROBE_TOKENS)
    block = probe_block(shape.dims, regime, probe_tokens)
    head = probe_head(shape.dims, regime, min(probe_tokens, 64))  # no attention: exactly linear
    per = lambda probe, key, n=None: probe[key] * tokens / (n or probe["tokens"])  # noqa: E731
    L = shape.layers
    rope = block["rope"] * seq_len / block["tokens"]  # cos/sin: one row per position, shared by the batch
    # Weight copies do not grow with tokens: one per weight, kept until its backward (with
    # checkpointing only the recomputed block's and lm_head's exist at once).
    if activation_checkpointing:
        blocks, recompute = L * per(block, "checkpointed", block["ckpt_tokens"]), per(block, "saved")
        copies = block["copies"] + head["copies"]
    else:
        blocks, recompute = L * per(block, "saved"), 0.0
        copies = L * block["copies"] + head["copies"]
    backward_block, backward_head = per(block, "backward_extra"), per(head, "backward_extra")
    return dict(activations=blocks + recompute + rope, blocks=blocks, recompute=recompute, rope=rope,
                logits=per(head, "saved"), weight_copies=copies, backward=backward_block + backward_head,
                backward_block=backward_block, backward_head=backward_head, tokens=tokens,
                probe=dict(block=block, head=head))


def regime_of(rung: Rung, precision: str) -> str:
    """Which probe regime a rung runs in: DDP/single autocast fp32 weights; DeepSpeed casts the
    module to bf16/fp16; FSDP2 computes with bf16/fp16 unsharded params (its autocast casts nothing)."""
    if precision == "fp32":
        return "fp32"
    return "autocast" if rung.framework in ("single", "ddp") else "low"


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Request:
    gpus: int = 1
    gpu_memory_gb: float = 80.0
    precision: str = "bf16"
    seq_len: int = 256
    micro_batch_size: int = 16
    activation_checkpointing: bool = False
    textbook: bool = False
    reserve_gb: float = 2.0
    host_memory_gb: float | None = None  # CPU RAM per machine; None: host RAM is not checked
    gpus_per_node: int | None = None  # GPUs per machine (None: 8); processes per machine = min(gpus, this)

    @property
    def usable(self) -> float:
        return (self.gpu_memory_gb - self.reserve_gb) * GB

    @property
    def procs_per_node(self) -> int:
        return min(self.gpus, self.gpus_per_node or 8)


TIGHT = 0.9  # a peak above this share of the usable GPU memory is printed "tight"


def evaluate(model: ModelShape | float, req: Request) -> list[dict]:
    """One row per rung, bytes per GPU (per process for host). Keys:
    rung, states (model_state_bytes), activations (activation_bytes or None), columns (the peak's
    composition: params, grads, optimizer, buffers, activations, logits), rest, peak (the largest of
    the three candidates), candidates {forward_backward, optimizer_step, init}, peak_at (which one),
    peak_in_step, host (CPU RAM per process after backward: offload), host_init (CPU RAM per process
    while the run starts), host_per_node (max(host, host_init) x processes per machine),
    host_fits (None when host RAM is not checked), gpu_fits, fits (bool: GPU and host), tight
    (fits, but the peak is above TIGHT x the usable GPU memory)."""
    shape = model if isinstance(model, ModelShape) else None
    n_params = shape.n_params if shape else float(model)
    rows = []
    for rung in ladder(req.gpus):
        states = model_state_bytes(rung, n_params, req.gpus, req.precision, shape, req.textbook)
        dev, tr = states["at_step"]["device"], states["transient"]
        act = (activation_bytes(shape, regime_of(rung, req.precision), req.seq_len, req.micro_batch_size,
                                req.activation_checkpointing) if shape else None)
        # Peak composition during forward/backward; each column's share of it. The blocks' backward
        # transient goes with the activations, the head's (the logits' gradient) with the logits.
        cols = dict(params=dev["params"] + tr["in_flight"] + (act["weight_copies"] if act else 0),
                    grads=dev["grads"] + tr["backward"], optimizer=dev["optimizer"], buffers=dev["buffers"],
                    activations=act["activations"] + act["backward_block"] if act else 0.0,
                    logits=act["logits"] + act["backward_head"] if act else 0.0)
        candidates = dict(forward_backward=sum(cols.values()), optimizer_step=dev["total"] + tr["optimizer_step"],
                          init=states["at_init"]["device"]["total"])
        peak_at = max(candidates, key=candidates.get)  # ties: forward_backward (listed first)
        peak = candidates[peak_at]
        host, host_init = states["at_step"]["host"]["total"], states["at_init"]["host"]["total"]
        host_per_node = max(host, host_init) * req.procs_per_node
        host_fits = None if req.host_memory_gb is None else host_per_node <= req.host_memory_gb * GB
        gpu_fits = peak <= req.usable
        fits = gpu_fits and host_fits is not False
        rows.append(dict(rung=rung, states=states, activations=act, columns=cols, rest=states["at_rest"]["device"]
                         ["total"], peak=peak, candidates=candidates, peak_at=peak_at,
                         peak_in_step=peak_at == "optimizer_step", host=host, host_init=host_init,
                         host_per_node=host_per_node, host_fits=host_fits, gpu_fits=gpu_fits, fits=fits,
                         tight=fits and peak > TIGHT * req.usable))
    return rows


def cheapest(rows: list[dict]) -> dict | None:
    """The rung to recommend: the cheapest that fits without being tight; else the cheapest tight
    one (its row says "tight": the caller warns); None when nothing fits."""
    return (next((r for r in rows if r["fits"] and not r["tight"]), None)
            or next((r for r in rows if r["fits"]), None))


def launch_line(rung: Rung, req: Request, model_args: str) -> str:
    """The command that trains with this rung (train.py supports every config)."""
    parts = ["accelerate launch", f"--config_file accelerate_configs/{rung.config}", f"--num_processes {req.gpus}"]
    if req.precision != "bf16":  # every config in the ladder says bf16
        parts.append(f"--mixed_precision {'no' if req.precision == 'fp32' else 'fp16'}")
    if req.activation_checkpointing and rung.framework == "fsdp":
        parts.append("--fsdp_activation_checkpointing true")  # the configs' advice: FSDP's own switch
    parts += ["recipes/train.py", model_args, f"--seq_len {req.seq_len}", f"--micro_batch_size {req.micro_batch_size}"]
    if req.activation_checkpointing and rung.framework != "fsdp":
        parts.append("--gradient_checkpointing")
    return " ".join(parts)


def smallest_gpu_count(model, req: Request, rung: Rung) -> int | None:
    """Fewest GPUs (> req.gpus, <= MAX_GPUS) with which `rung` fits. Per-GPU bytes never grow with
    the GPU count, so a bisection finds it once the machines are full; below that, more GPUs put
    more processes on one machine (host RAM grows), so those counts are tried one by one. None when
    even MAX_GPUS is not enough (DDP never shrinks; activations and logits never shrink: each GPU
    runs its own micro-batch)."""
    def fits(n):
        return any(r["fits"] for r in evaluate(model, dataclasses.replace(req, gpus=n)) if r["rung"].name == rung.name)

    if rung.framework in ("single", "ddp"):
        return None
    full = max(req.gpus, req.gpus_per_node or 8)  # from here on, processes per machine stay the same
    if req.host_memory_gb is not None:
        found = next((n for n in range(req.gpus + 1, min(full, MAX_GPUS) + 1) if fits(n)), None)
        if found:
            return found
    if not fits(MAX_GPUS):
        return None
    lo, hi = (full if req.host_memory_gb is not None else req.gpus), MAX_GPUS  # fits(hi) holds, fits(lo) not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def more_gpus(model, req: Request, model_args: str, offload: bool = True) -> str:
    """The smallest GPU count that fits, for the rung that needs the fewest (cheaper on ties)."""
    counts = [(n, i, r) for i, r in enumerate(LADDER)
              if (offload or not r.offload) and (n := smallest_gpu_count(model, req, r))]
    if not counts:
        return (f"  - more GPUs: no {'' if offload else 'non-offload '}config fits with up to {MAX_GPUS} GPUs "
                "(activations and logits do not shrink with more GPUs: each GPU runs its own micro-batch)")
    n, _, rung = min(counts)
    per = req.gpus_per_node or 8
    nodes = (f" ({math.ceil(n / per)} nodes of {per}: add --num_machines/--machine_rank/--main_process_ip)"
             if n > per else "")
    return (f"  - more GPUs: {n} x {req.gpu_memory_gb:g} GB with {rung.config}{nodes}\n"
            f"      {launch_line(rung, dataclasses.replace(req, gpus=n), model_args)}")


def advice(model, req: Request, model_args: str) -> list[str]:
    """When nothing fits: try each lever concretely and say which ones work, with launch lines."""
    lines = []
    shape = model if isinstance(model, ModelShape) else None

    def host_short(r: dict) -> str:
        return (f"needs {r['host_per_node'] / GB:.1f} GB of CPU RAM per machine ({req.procs_per_node} x "
                f"{max(r['host'], r['host_init']) / GB:.1f} GB), more than --host_memory_gb {req.host_memory_gb:g}")

    def report(what, new_req):
        rows = evaluate(model, new_req)
        best = cheapest(rows)
        if best:
            tight = f", tight: above {TIGHT:.0%} of usable" if best["tight"] else ""
            lines.append(f"  - {what}: {best['rung'].config} fits (peak {best['peak'] / GB:.1f} GB{tight})")
            lines.append(f"      {launch_line(best['rung'], new_req, model_args)}")
        elif (gpu_only := next((r for r in rows if r["gpu_fits"]), None)):
            lines.append(f"  - {what}: still does not fit ({gpu_only['rung'].config} would fit the GPU, peak "
                         f"{gpu_only['peak'] / GB:.1f} GB, but {host_short(gpu_only)})")
        else:
            lines.append(f"  - {what}: still does not fit")
        return best

    lines.append(more_gpus(model, req, model_args))
    if (gpu_only := next((r for r in evaluate(model, req) if r["gpu_fits"]), None)):
        lines.append(f"  - more CPU RAM: {gpu_only['rung'].config} fits the GPUs (peak {gpu_only['peak'] / GB:.1f} GB) "
                     f"with {gpu_only['host_per_node'] / GB:.1f} GB of CPU RAM per machine (--host_memory_gb)")
    if shape is None:
        lines.append("  - micro-batch / activation checkpointing: unknown without the model's shape")
        return lines
    # Offload: what the GPU would still hold.
    off = [r for r in evaluate(model, req) if r["rung"].offload]
    best_off = min(off, key=lambda r: r["peak"])
    states = best_off["columns"]["params"] + best_off["columns"]["grads"] + best_off["columns"]["buffers"]
    if best_off["gpu_fits"]:  # then host RAM is what fails
        lines.append(f"  - offload ({best_off['rung'].config}) fits the GPU (peak {best_off['peak'] / GB:.1f} GB) but "
                     f"{host_short(best_off)}")
    else:
        host = f"; and it {host_short(best_off)}" if best_off["host_fits"] is False else ""
        lines.append(f"  - offload alone ({best_off['rung'].config}): still {best_off['peak'] / GB:.1f} GB per GPU, "
                     f"of which {(best_off['columns']['activations'] + best_off['columns']['logits']) / GB:.1f} GB "
                     f"activations + logits and {states / GB:.1f} GB parameters/gradients in flight: does not fit"
                     f"{host}")
    ac_works = not req.activation_checkpointing and report("activation checkpointing",
                                                              dataclasses.replace(req, activation_checkpointing=True))

    def largest_micro(r: Request) -> int | None:
        return next((m for m in range(r.micro_batch_size - 1, 0, -1)
                     if cheapest(evaluate(model, dataclasses.replace(r, micro_batch_size=m)))), None)

    micro = largest_micro(req) if req.micro_batch_size > 1 else None
    if micro:
        k = math.ceil(req.micro_batch_size / micro)
        report(f"micro_batch_size {micro} (with --gradient_accumulation_steps {k}: at least the same batch)",
               dataclasses.replace(req, micro_batch_size=micro))
    elif req.micro_batch_size > 1:
        lines.append("  - smaller micro-batch: not even micro_batch_size 1 fits")
    if not (ac_works or micro or req.activation_checkpointing):  # neither lever alone: both together
        both = dataclasses.replace(req, activation_checkpointing=True)
        if (micro := largest_micro(both)):
            report(f"activation checkpointing + micro_batch_size {micro}", dataclasses.replace(both, micro_batch_size=micro))
        else:
            report("activation checkpointing + micro_batch_size 1", dataclasses.replace(both, micro_batch_size=1))
    return lines


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2 (argparse prints usage + error otherwise)
        raise PlanError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m common.plan", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_mutually_exclusive_group()
    m.add_argument("--preset", help="model preset of common/model.py (byte vocabulary, 259); default tiny")
    m.add_argument("--model_name_or_path", help="local folder with a Hugging Face config.json (nothing is downloaded)")
    m.add_argument("--params", type=float, help="parameter count only (e.g. 7e9): model states only")
    p.add_argument("--gpus", type=int, default=1, help="GPUs (processes), default 1")
    p.add_argument("--gpus_per_node", type=int, help="GPUs per machine, for the host RAM check (processes per "
                                                      "machine: min(--gpus, this)); default 8")
    p.add_argument("--host_memory_gb", type=float,
                   help="CPU RAM per machine, GB; checked against every process's CPU RAM (offload, and the fp32 "
                        "model each process builds on the CPU). Default: not checked")
    p.add_argument("--gpu_memory_gb", type=float, default=80.0, help="memory per GPU, GB (1e9 bytes), default 80")
    p.add_argument("--reserve_gb", type=float, default=2.0,
                   help="left out of each GPU for the CUDA context, NCCL buffers and fragmentation, default 2")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16", help="default bf16")
    p.add_argument("--seq_len", type=int, default=256, help="tokens per sequence (train.py's default: 256)")
    p.add_argument("--micro_batch_size", type=int, default=16, help="sequences per GPU per step (train.py's: 16)")
    p.add_argument("--activation_checkpointing", action="store_true", help="checkpoint every block")
    p.add_argument("--textbook", action="store_true", help="model states from the ZeRO paper instead")
    return p


def _check(args) -> None:
    for name in ("gpu_memory_gb", "reserve_gb", "params", "host_memory_gb"):
        value = getattr(args, name)
        if value is not None and not math.isfinite(value):
            raise PlanError(f"--{name} must be a finite number, got {value:g}")
    if args.gpus <= 0:
        raise PlanError(f"--gpus must be a positive number of GPUs, got {args.gpus}")
    if not args.gpu_memory_gb > 0:
        raise PlanError(f"--gpu_memory_gb must be positive, got {args.gpu_memory_gb:g}")
    if not 0 <= args.reserve_gb < args.gpu_memory_gb:
        raise PlanError(f"--reserve_gb must be in [0, --gpu_memory_gb), got {args.reserve_gb:g}")
    if args.seq_len <= 0 or args.micro_batch_size <= 0:
        raise PlanError("--seq_len and --micro_batch_size must be positive")
    if args.params is not None and not args.params >= 1:
        raise PlanError(f"--params must be a positive parameter count, got {args.params:g}")
    if args.gpus_per_node is not None and args.gpus_per_node <= 0:
        raise PlanError(f"--gpus_per_node must be a positive number of GPUs, got {args.gpus_per_node}")
    if args.host_memory_gb is not None and not args.host_memory_gb > 0:
        raise PlanError(f"--host_memory_gb must be positive, got {args.host_memory_gb:g}")


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _gb(x: float) -> str:
    return f"{x / GB:7.2f}" if x >= 0.995e9 or x == 0 else f"{x / GB:7.3f}"


MEASURED_GAPS = ("measured on CPU (benchmarks/results/memory-2026-11-30: 113.7M parameters, 2 ranks, bf16), "
                 "the peak was ABOVE the plan under DeepSpeed (ZeRO-1 +6%, ZeRO-2 +8%, ZeRO-3 +22%, ZeRO-3 offload "
                 "+23%) and 10-14% below it under DDP and FSDP2")


def _fits_word(row: dict) -> str:
    if row["fits"]:
        return "tight" if row["tight"] else "yes"
    return "no" if not row["gpu_fits"] else "no (host RAM)"


def _vocab_note(shape: ModelShape) -> str | None:
    """Presets use the byte tokenizer: say so, since a real model's vocabulary costs much more."""
    if shape.preset is None:
        return None
    real = (" (a real Llama-3-8B config has a 128,256-token vocabulary: 8.03B parameters, and logits "
            "~500x larger per token)" if shape.preset == "8b" else "")
    return (f"Vocabulary: {shape.vocab} tokens, the byte tokenizer of the presets{real}. A real tokenizer "
            "adds embedding/LM-head parameters and much larger logits: for a real model pass "
            "--model_name_or_path <local folder with its config.json>.")


def render(model, req: Request, rows: list[dict], model_args: str) -> str:
    shape = model if isinstance(model, ModelShape) else None
    out = []
    if shape:
        out.append(f"Memory plan for {shape.name}: {_count(shape.n_params)} parameters ({shape.layers} blocks of "
                   f"{_count(shape.block_params)}, hidden {shape.hidden}, vocab {shape.vocab}"
                   f"{', tied embeddings' if shape.tied else ''})")
        if (note := _vocab_note(shape)):
            out.append(note)
    else:
        out.append(f"Memory plan for {_count(float(model))} parameters (no shape: model states only)")
    out.append(f"{req.gpus} x {req.gpu_memory_gb:g} GB GPUs ({req.usable / GB:g} GB usable each: {req.reserve_gb:g} GB "
               f"reserved for CUDA context, NCCL, fragmentation), {req.precision}, seq_len {req.seq_len}, "
               f"micro_batch_size {req.micro_batch_size}, activation checkpointing "
               f"{'on' if req.activation_checkpointing else 'off'}")
    if req.textbook:
        out.append("Model states: ZeRO paper (fp16 mixed precision, Adam, K=12), not what the frameworks keep here. "
                   "FSDP2 rows are analogies (the paper has no FSDP): no reshard ~ ZeRO-2 (2 + 14/W: every "
                   "parameter gathered from forward to backward), full shard ~ ZeRO-3 (16/W); FSDP2 here keeps "
                   "12/W between steps and +4/W gradients. Offload rows: ZeRO-3's 16/W in CPU RAM.")
    if shape:
        probes = {regime_of(r["rung"], req.precision) for r in rows}
        secs = sum(probe_block(shape.dims, g, min(req.seq_len, PROBE_TOKENS))["seconds"] for g in probes)
        out.append(f"Activations measured on one {'Llama' if shape.llama else 'Llama-shaped'} decoder block "
                   f"({', '.join(sorted(probes))}; {min(req.seq_len, PROBE_TOKENS)} tokens, {secs:.1f} s), scaled to "
                   f"{req.micro_batch_size * req.seq_len} tokens per GPU (assumes O(seq) attention: flash/SDPA).")
    else:
        out.append("WARNING: --params gives no shape: activations, logits, buckets and parameters in flight are "
                   "UNKNOWN; 'fits' below judges model states alone and will be optimistic.")
    out.append("")
    out.append("Per GPU, GB (1 GB = 1e9 bytes). rest = between steps. peak = the largest of: forward/backward "
               "(= params + grads + optim + buffers + activ + logits), inside optimizer.step() (*), initialisation (^).")
    out.append("  params: parameters + those in flight (all-gathered / fetched) + autocast's weight copies; grads: "
               "gradients + backward buffers;")
    out.append("  activ: what the blocks keep for backward + one block's backward transient (+ the recomputed block "
               "with checkpointing);")
    out.append("  logits: what embedding / final norm / LM head / fp32 cross-entropy keep + the logits' gradient "
               "during the head's backward;")
    out.append("  host: CPU RAM per process after backward (offload); h.init: CPU RAM per process while the run "
               "starts (the fp32 model built on the CPU).")
    out.append(f"  fits: yes; tight = fits, peak above {TIGHT:.0%} of usable; no; no (host RAM) = fits the GPU, "
               "not --host_memory_gb.")
    head = (f"   {'rung':<18}{'config':<29}{'rest':>7} |{'params':>7} {'grads':>7} {'optim':>7} {'buffers':>7} "
            f"{'activ':>7} {'logits':>7} |{'peak':>7} {'host':>7} {'h.init':>7}  fits")
    out.append(head)
    for i, r in enumerate(rows, 1):
        c = r["columns"]
        mark = {"optimizer_step": "*", "init": "^"}.get(r["peak_at"], " ")
        out.append(f"{i:>2} {r['rung'].label:<18}{r['rung'].config:<29}{_gb(r['rest'])} |{_gb(c['params'])} "
                   f"{_gb(c['grads'])} {_gb(c['optimizer'])} {_gb(c['buffers'])} {_gb(c['activations'])} "
                   f"{_gb(c['logits'])} |{_gb(r['peak'])}{mark}{_gb(r['host'])} {_gb(r['host_init'])}  "
                   f"{_fits_word(r)}")
    if any(r["peak_at"] == "optimizer_step" for r in rows):
        out.append("* peak inside optimizer.step() (its temporary fp32 gradient copies), not in forward/backward")
    if any(r["peak_at"] == "init" for r in rows):
        out.append("^ peak while the run starts (the framework's states + its temporary buffers), not in training")
    procs = req.procs_per_node
    if req.host_memory_gb is None:
        out.append(f"host RAM not checked (pass --host_memory_gb): a machine needs max(host, h.init) x {procs} "
                   f"process{'es' if procs > 1 else ''}, plus the OS, CUDA contexts and data loaders")
    else:
        out.append(f"host RAM checked: max(host, h.init) x {procs} process{'es' if procs > 1 else ''} per machine "
                   f"<= {req.host_memory_gb:g} GB (--host_memory_gb; the OS, CUDA contexts and data loaders "
                   "are not counted)")
    if not req.textbook:
        out.append(f"Not an upper bound: {MEASURED_GAPS}; see the module docstring for what is and is not modelled.")
    out.append("")
    best = cheapest(rows)
    if best:
        tight_cheaper = [r for r in rows[:rows.index(best)] if r["fits"]]
        if tight_cheaper:
            out.append(f"Cheaper but tight (peak above {TIGHT:.0%} of usable): " + ", ".join(
                f"{r['rung'].config} ({r['peak'] / GB:.1f} GB)" for r in tight_cheaper)
                + "; recommended the cheapest with headroom:")
        if best["tight"]:
            out.append(f"WARNING: only tight configs fit: the peak leaves less than {1 - TIGHT:.0%} of usable memory "
                       "for what the plan does not model (allocator fragmentation; under DeepSpeed the measured "
                       "peak was up to 23% above the plan). Consider activation checkpointing, a smaller "
                       "micro-batch or more GPUs.")
        out.append(f"fits: {best['rung'].config} ({best['rung'].label}) is the cheapest config that fits"
                   f"{' (tight)' if best['tight'] else ''}: peak {best['peak'] / GB:.1f} of {req.usable / GB:g} GB "
                   "usable per GPU")
        out.append(f"  {launch_line(best['rung'], req, model_args)}")
        if not shape:
            out.append("  (judged on model states only: add the shape with --preset or --model_name_or_path)")
        if best["rung"].offload:  # offload is slow: say what would avoid it
            out.append("Offload is slow (optimizer step on the CPU, parameters over PCIe); without it:")
            out.append(more_gpus(model, req, model_args, offload=False))
    else:
        out.append(f"Nothing fits on {req.gpus} x {req.gpu_memory_gb:g} GB. What would, checked one lever at a time:")
        out += advice(model, req, model_args)
        out.append(f"nothing fits: no config in accelerate_configs/ fits {req.gpus} x {req.gpu_memory_gb:g} GB "
                   "as asked (see above for what would)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        _check(args)
        req = Request(gpus=args.gpus, gpu_memory_gb=args.gpu_memory_gb, precision=args.precision,
                      seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                      activation_checkpointing=args.activation_checkpointing, textbook=args.textbook,
                      reserve_gb=args.reserve_gb, host_memory_gb=args.host_memory_gb,
                      gpus_per_node=args.gpus_per_node)
        if args.params is not None:
            model, model_args = args.params, "--model_name_or_path <MODEL>"
        else:
            preset = args.preset or ("tiny" if args.model_name_or_path is None else None)
            model = model_shape(preset, args.model_name_or_path)
            model_args = (f"--model_name_or_path {args.model_name_or_path}" if args.model_name_or_path
                          else f"--preset {preset}")
            if model.max_positions is not None and args.seq_len > model.max_positions:
                raise PlanError(f"--seq_len {args.seq_len} exceeds the {model.max_positions} positions of {model.name}")
        print(render(model, req, evaluate(model, req), model_args))
        return 0
    except PlanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
