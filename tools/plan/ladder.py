"""The ladder of strategies (each rung a config in accelerate_configs/) and the model's shape,
read on the meta device (no memory, no download)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass



GB = 1e9
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_DIR = os.path.join(ROOT, "accelerate_configs")
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
    hybrid: bool = False  # HSDP: FSDP2 over the GPUs of one machine, one sharded copy per machine
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
# Only over whole machines (ladder() below): per GPU, FSDP2 full shard with W = GPUs per machine.
HSDP = Rung("hsdp", "multi_node_hsdp.yaml", "fsdp", hybrid=True, label="HSDP")
RUNGS = {r.name: r for r in (SINGLE, HSDP) + LADDER} | {r.config: r for r in (SINGLE, HSDP) + LADDER}
GPUS_PER_NODE = 8  # when --gpus_per_node is not given


def ladder(gpus: int, gpus_per_node: int | None = None) -> tuple[Rung, ...]:
    """The rungs for this GPU count: with one GPU the first rung is a plain single-GPU run. Over
    several whole machines HSDP comes first of the FSDP2 rungs: across machines it sends only an
    all-reduce of each GPU's 1/G gradient shard, where they send every all-gather and reduce-scatter."""
    if gpus == 1:
        return (SINGLE,) + LADDER[1:]
    per_node = gpus_per_node or GPUS_PER_NODE
    if gpus > per_node and gpus % per_node == 0:
        first_fsdp = next(i for i, r in enumerate(LADDER) if r.framework == "fsdp")
        return LADDER[:first_fsdp] + (HSDP,) + LADDER[first_fsdp:]
    return LADDER


def get_rung(rung: Rung | str) -> Rung:
    if isinstance(rung, Rung):
        return rung
    if rung not in RUNGS:
        names = ", ".join(r.name for r in (SINGLE,) + LADDER + (HSDP,))
        raise PlanError(f"unknown rung {rung!r}; choose one of {names}")
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
    # Compute (train_extras/observe/flops.py): a mixture of experts holds every expert (memory: n_params)
    # but sends each token through top_k of its `experts` routed ones. Dense: active_params == n_params.
    active_params: int | None = None  # parameters one token uses (flops.parameter_counts "active")
    active_matmul_params: int | None = None  # N of 6N (flops.active_matmul_params)
    # N as MFU counts it: every expert where the experts module runs them all (flops.dense_experts)
    spent_matmul_params: int | None = None
    dense_experts: str | None = None
    mixers: tuple = ()  # each layer's attention / SSM / linear attention (flops.mixers)
    experts: int = 0  # routed experts per MoE layer (0: dense)
    top_k: int = 0  # of them per token
    muon_params: int = 0  # --optimizer muon's part: the hidden matrices (train_extras/muon.py); AdamW has the rest
    # --lora_r: the adapters train.py would inject (train_extras/lora.py, counted by peft on the meta
    # model); 0 without. The base's n_params stay frozen.
    lora_params: int = 0
    lora_largest: int = 0  # the largest adapter tensor (ZeRO-3's one module gradient)

    def flops_per_token(self, seq_len: int) -> float | None:
        """Training FLOPs per token at seq_len, as train.py's MFU counts them (flops.flops_per_token)."""
        if self.spent_matmul_params is None:
            return None
        from train_extras.observe import flops

        return flops.per_token(self.spent_matmul_params, self.mixers, seq_len)

    @property
    def dims(self) -> tuple:
        return (self.hidden, self.intermediate, self.heads, self.kv_heads, self.head_dim, self.vocab, self.rms_eps)


def load_config(preset: str | None = None, model_name_or_path: str | None = None):
    """The transformers config: a preset (byte vocabulary, 259) or a local folder's config.json."""
    from common.config import PRESET_NAMES, RecipeConfig
    from common.model import model_config

    if model_name_or_path is not None:
        if not os.path.isdir(model_name_or_path):
            raise PlanError(f"--model_name_or_path {model_name_or_path}: no such folder (the planner reads a local "
                            "config.json and downloads nothing)")
        if not os.path.isfile(os.path.join(model_name_or_path, "config.json")):
            raise PlanError(f"--model_name_or_path {model_name_or_path}: no config.json in that folder")
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(model_name_or_path, trust_remote_code=False)  # reads, runs nothing
        except (OSError, ValueError, KeyError) as err:
            raise PlanError(f"cannot read {model_name_or_path}/config.json: {str(err).splitlines()[0]}") from None
    if preset not in PRESET_NAMES:
        raise PlanError(f"unknown preset {preset!r}; choose one of {', '.join(PRESET_NAMES)}")
    return model_config(RecipeConfig(preset=preset), vocab_size=259)


@functools.lru_cache(maxsize=8)
def model_shape(preset: str | None = None, model_name_or_path: str | None = None,
                lora_r: int | None = None) -> ModelShape:
    """Parameter counts and dimensions, from the real model class built on the meta device; with
    lora_r, the adapters train.py's --lora_r injects into it, counted."""
    import torch
    from transformers import AutoModelForCausalLM

    config = load_config(preset, model_name_or_path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as err:
        raise PlanError(f"cannot build a causal LM from that config: {str(err).splitlines()[0]}") from None
    from common.config import ConfigError
    from train_extras import muon
    from train_extras.observe import flops

    try:  # compute from the parameters a token uses (a mixture of experts: top-k of its experts)
        counts, moe = flops.parameter_counts(config, model), flops.routed_experts(config, model)
        active_matmul = flops.active_matmul_params(config, model)
        mixers, dense = flops.mixers(config, model), flops.dense_experts(config, model)
    except ConfigError as err:
        raise PlanError(str(err)) from None
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
            # the MLP width under each family's name (GPT-2: n_inner, None = 4 x hidden; OPT: ffn_dim)
            intermediate=(getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None)
                          or getattr(text, "ffn_dim", None) or 4 * text.hidden_size),
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
            active_params=counts["active"],
            active_matmul_params=active_matmul,
            spent_matmul_params=flops.matmul_params(config, model) if dense else active_matmul,
            dense_experts=dense,
            mixers=mixers,
            experts=moe["experts"] if moe else 0,
            top_k=moe["top_k"] if moe else 0,
            muon_params=sum(p.numel() for p in muon.hidden_matrices(model)),
            **(_adapters(model, lora_r) if lora_r else {}),
        )
    except AttributeError as err:  # the probe needs a Llama-like decoder's fields
        raise PlanError(f"{model_name_or_path}: not a Llama-like decoder config ({err})") from None




def _adapters(model, lora_r: int) -> dict:
    """The adapters train.py's --lora_r puts in this model (its default targets), injected on the meta device."""
    import importlib.util
    from types import SimpleNamespace

    from common.config import ConfigError
    from train_extras import lora

    if importlib.util.find_spec("peft") is None:
        raise PlanError("--lora_r counts the adapters with peft, which is not installed: pip install -e '.[lora]'")
    options = SimpleNamespace(lora_r=lora_r, lora_alpha=None, lora_dropout=0.0, lora_target_modules=None)
    try:
        lora.apply(model, options)
    except ConfigError as err:
        raise PlanError(str(err)) from None
    sizes = [p.numel() for name, p in model.named_parameters() if ".lora_" in name]
    return {"lora_params": sum(sizes), "lora_largest": max(sizes, default=0)}
