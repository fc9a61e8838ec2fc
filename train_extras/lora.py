"""LoRA in train.py (`--lora_r`): low-rank adapters trained on a frozen base model, with peft.

Each adapted linear layer W gets two small matrices, A (r x in) and B (out x r), and computes
W x + alpha/r * B A x. B starts at zero, so at step 0 the model is exactly the base model. Only A
and B get gradients and optimizer state: for a rank of 16 on an 8B model, about 40M trainable
parameters instead of 8B, so gradients and AdamW's moments shrink by about 200x, while the base
weights stay as they are (bit for bit, tested).

Which layers (--lora_target_modules, default `targets`): every linear layer, by the names the
family gives them (q_proj, c_attn, query_key_value...), found from the model, except the output
head, the linear children of an MoE block (its router, a shared expert's gate) and the projections
of state-space mixers (Mamba, gated DeltaNet), whose fused kernels read weights past an adapter.
An MoE's routed experts, which transformers 5 fuses into 3-D parameters (experts x out x in), get
adapters on those parameters (peft's target_parameters, `expert_targets`); the run's record lists
them. With --lora_target_modules given, only those names (for the MLP names of families it knows,
peft 0.21 maps them onto the fused experts itself: its transformers v4 -> v5 conversion).
Checked on the 15 families of tests/families.py (tests/test_lora.py).

Adapters are injected in place (peft's inject_adapter_in_model): the model stays the transformers
model the rest of train.py knows (document masks, the chunked loss, FSDP2's blocks), its adapted
layers peft's LoRA layers holding the base layer. Checkpoints hold the whole model state (the
base too) and the adapters' optimizer state: a resume is exact, as without adapters.

Export (`writer`, through common/export.py): <output_dir>/model is the adapter folder peft writes and loads
(adapter_config.json, adapter_model.safetensors with peft's `base_model.model.` names, the
tokenizer): `PeftModel.from_pretrained(base, folder)`. With --lora_merge, <output_dir>/model_merged
is the base with the adapters merged in (peft's merge_and_unload), in the run's precision, a model
`from_pretrained` loads alone.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

from torch import nn

from common.config import ConfigError

ADAPTER = "default"  # peft's name for a model's one adapter


def targets(model: nn.Module) -> list[str]:
    """The layer names to adapt: those of every linear layer in the model but the output head, an MoE
    block's own linear children (its router, a shared expert's gate) and a state-space mixer's."""
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers (weights stored transposed)

    from train_extras.moe import sparse_block_classes

    sparse = tuple(sparse_block_classes(model))
    skip = {id(model.get_output_embeddings())}
    skip |= {id(child) for module in model.modules() if sparse and isinstance(module, sparse)
             for child in module.children() if isinstance(child, nn.Linear)}
    # state-space mixers (Mamba, Mamba2, gated DeltaNet: they own an A_log): their fused kernels read
    # some of their weights directly, past an adapter (peft refuses out_proj for falcon_h1 and mamba)
    skip |= {id(child) for module in model.modules() if isinstance(getattr(module, "A_log", None), nn.Parameter)
             for child in module.modules() if isinstance(child, nn.Linear)}
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, (nn.Linear, Conv1D)) and id(module) not in skip})


def expert_targets(model: nn.Module) -> list[str]:
    """The routed experts' fused weights (3-D: experts x out x in), as peft's target_parameters
    (`experts.gate_up_proj`): transformers 5 holds an MoE's experts so, not as linear layers."""
    from train_extras.moe import sparse_block_classes
    from train_extras.observe.flops import is_experts

    sparse = tuple(sparse_block_classes(model))
    return sorted({f"{name}.{param}" for module in model.modules() if sparse and isinstance(module, sparse)
                   for name, child in module.named_children() if is_experts(name, child)
                   for param, tensor in child.named_parameters(recurse=False)
                   if len(getattr(tensor, "ds_shape", tensor.shape)) == 3})  # (ZeRO-3 partitions: ds_shape)


def lora_config(cfg, model: nn.Module):
    from peft import LoraConfig

    chosen = cfg.lora_target_modules  # given: those names alone (peft's own mapping may add experts)
    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha or 2 * cfg.lora_r, lora_dropout=cfg.lora_dropout,
                      target_modules=list(chosen or targets(model)),
                      target_parameters=None if chosen else expert_targets(model) or None, task_type="CAUSAL_LM")


def apply(model: nn.Module, cfg, tensor_parallel: bool = False) -> dict | None:
    """Adapters injected in place (the base frozen); what the run's record says about them. None
    without --lora_r."""
    if not cfg.lora_r:
        return None
    if tensor_parallel:  # the TP plan splits the layers by their names, which adapters change
        raise ConfigError("--lora_r with tensor parallelism is not supported: use FSDP2 or ZeRO-3 for a base model "
                          "too large for one device")
    from peft import inject_adapter_in_model

    config = lora_config(cfg, model)
    try:
        inject_adapter_in_model(config, model, ADAPTER)
    except ValueError as err:  # peft's "Target modules {...} not found in the base model"
        raise ConfigError(f"--lora_target_modules: {str(err).splitlines()[0]}") from None
    model.lora_config = config  # read back by the export
    adapted = {re.sub(r"(\.base_layer)+", "", name.rsplit(".lora_A", 1)[0]) for name, _ in model.named_parameters()
               if ".lora_A." in name}  # (peft's wrapper of an MoE's fused experts nests a base_layer)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"r": config.r, "alpha": config.lora_alpha, "dropout": config.lora_dropout,
            "target_modules": sorted(config.target_modules),
            "target_parameters": sorted(getattr(config, "target_parameters", None) or []),
            "adapted_layers": len(adapted), "trainable_parameters": trainable}


def describe(facts: dict) -> str:
    targets_ = ", ".join(facts["target_modules"] + facts["target_parameters"])
    return (f"rank {facts['r']}, alpha {facts['alpha']:g} on {facts['adapted_layers']} layers ({targets_}): "
            f"{facts['trainable_parameters']:,} trainable parameters, the base frozen")


def peft_names(state_dict: dict) -> dict:
    """The adapters' tensors, named as peft saves one adapter: `base_model.model.` + the layer's name
    + `.lora_A.weight` (the live names carry the adapter's name: `.lora_A.default.weight`)."""
    return {f"base_model.model.{key.replace(f'.{ADAPTER}.', '.')}": value
            for key, value in state_dict.items() if ".lora_" in key}


def base_state(state_dict: dict) -> dict:
    """The base model's tensors, under its own names (an adapted layer's weight is `base_layer.weight`)."""
    # (peft nests one base_layer per adapted tensor: an MoE's experts have two, gate_up_proj and down_proj)
    return {re.sub(r"(\.base_layer)+\.", ".", key): value for key, value in state_dict.items() if ".lora_" not in key}


def writer(merged_dir: Path | None, tokenizer):
    """export_pretrained's `write` for a LoRA run: the adapter folder, and with --lora_merge the merged
    model beside it (written whole, then swapped in, with the export marker, as every export)."""
    def write(folder: Path, model: nn.Module, state_dict: dict) -> None:
        from safetensors.torch import save_file

        folder.mkdir()
        save_file({k: v.contiguous() for k, v in peft_names(state_dict).items()},
                  str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        model.lora_config.save_pretrained(str(folder))
        if merged_dir is not None:
            write_merged(folder, model, state_dict, Path(merged_dir), tokenizer)
    return write


def write_merged(adapter_folder: Path, model: nn.Module, state_dict: dict, out_dir: Path, tokenizer) -> None:
    """The base rebuilt from the run's weights, the adapter folder loaded onto it by peft and merged
    (merge_and_unload), each tensor saved in the export's dtype for it: what a user would do with
    the two folders."""
    from peft import PeftModel

    from common.export import check_replaceable, deepspeed_absent, mark_export
    from common.files import partial_dir, recover_dir, replace_dir
    from train_extras.observe.flops import deepspeed_hidden

    recover_dir(out_dir)
    check_replaceable(out_dir)
    weights = base_state(state_dict)
    with deepspeed_hidden():  # this process alone: no zero.Init (a collective) under ZeRO-3
        base = type(model)._from_config(model.config)
    missing, unexpected = base.load_state_dict(weights, strict=False)
    tied = {n for n, _ in base.named_parameters(remove_duplicate=False)} - {n for n, _ in base.named_parameters()}
    if unexpected or set(missing) - tied:  # the export keeps one copy of a tied table, nothing else may lack
        raise RuntimeError(f"the merged export's base: unexpected {unexpected[:3]}, missing {missing[:3]}")
    with warnings.catch_warnings():  # peft 0.21 asks transformers 5 for a renamed attribute
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        merged = PeftModel.from_pretrained(base, str(adapter_folder)).merge_and_unload()
    partial = partial_dir(out_dir)
    with deepspeed_absent(True):  # a plain model: no DeepSpeed engine to unwrap (common/export.py)
        merged.save_pretrained(partial, state_dict={k: v.to(weights[k].dtype) for k, v in merged.state_dict().items()})
    merged.config.dtype = next(v.dtype for v in weights.values() if v.is_floating_point())
    merged.config.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    mark_export(partial)
    replace_dir(out_dir)
