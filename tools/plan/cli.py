"""`python -m tools.plan`: its options, their checks, and the printed table."""

from __future__ import annotations

import argparse
import math
import sys

from tools.plan.ladder import GB, ModelShape, PROBE_TOKENS, PlanError, model_shape
from tools.plan.advice import Request, TIGHT, advice, cheapest, evaluate, launch_line, more_gpus
from tools.plan.activations import probe_block, regime_of


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2 (argparse prints usage + error otherwise)
        raise PlanError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m tools.plan", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_mutually_exclusive_group()
    m.add_argument("--preset", help="model preset of common/model.py (byte vocabulary, 259); default tiny")
    m.add_argument("--model_name_or_path", help="local folder with a Hugging Face config.json (nothing is downloaded)")
    m.add_argument("--params", type=float, help="parameter count only (e.g. 7e9): model states only")
    p.add_argument("--gpus", type=int, default=1, help="GPUs (processes), default 1")
    p.add_argument("--gpus_per_node", type=int, help="GPUs per machine: the host RAM check (processes per "
                                                      "machine: min(--gpus, this)) and HSDP's shard group (the HSDP "
                                                      "rung appears when --gpus is a multiple > 1 of it); default 8")
    p.add_argument("--host_memory_gb", type=float,
                   help="CPU RAM per machine, GB; checked against every process's CPU RAM (offload, and the fp32 "
                        "model each process builds on the CPU). Default: not checked")
    p.add_argument("--gpu_memory_gb", type=float, default=80.0, help="memory per GPU, GB (1e9 bytes), default 80")
    p.add_argument("--reserve_gb", type=float, default=2.0,
                   help="left out of each GPU for the CUDA context, NCCL buffers and fragmentation, default 2")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16", help="default bf16")
    p.add_argument("--seq_len", type=int, default=256, help="tokens per sequence (train.py's default: 256)")
    p.add_argument("--micro_batch_size", type=int, default=16, help="sequences per GPU per step (train.py's: 16)")
    p.add_argument("--activation_checkpointing", nargs="?", const="full", default="none",
                   choices=("none", "full", "selective"),
                   help="train.py's --gradient_checkpointing: full (every block keeps its input; the flag alone), "
                        "selective (matmul and attention outputs kept, the rest recomputed) or none (default)")
    p.add_argument("--loss_chunk_size", type=int, default=0,
                   help="train.py's: the LM head and cross-entropy N tokens at a time (default 0: all at once)")
    p.add_argument("--textbook", action="store_true", help="model states from the ZeRO paper instead")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="train.py's --optimizer: muon keeps one fp32 state per hidden-matrix parameter, AdamW two; "
                        "Muon rungs: one GPU and DDP only (default adamw)")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1, help="train.py's (default 1)")
    p.add_argument("--fsdp_sync_each_batch", choices=("true", "false"), default="true",
                   help="train.py's: false keeps FSDP2's whole unsharded fp32 gradient between micro-batches "
                        "(with accumulation); default true, a shard's")
    p.add_argument("--lora_r", type=int, help="train.py's --lora_r: LoRA adapters of this rank on its default targets "
                                              "are the only trained parameters (needs peft)")
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
    if args.loss_chunk_size < 0:
        raise PlanError(f"--loss_chunk_size must be >= 0 (0: the plain loss), got {args.loss_chunk_size}")
    if args.seq_len <= 0 or args.micro_batch_size <= 0 or args.gradient_accumulation_steps <= 0:
        raise PlanError("--seq_len, --micro_batch_size and --gradient_accumulation_steps must be positive")
    if args.params is not None and not args.params >= 1:
        raise PlanError(f"--params must be a positive parameter count, got {args.params:g}")
    if args.gpus_per_node is not None and args.gpus_per_node <= 0:
        raise PlanError(f"--gpus_per_node must be a positive number of GPUs, got {args.gpus_per_node}")
    if args.optimizer == "muon" and (args.params is not None or args.textbook):
        raise PlanError("--optimizer muon needs the model's shape (--preset or --model_name_or_path), not --params "
                        "or --textbook: it counts the hidden matrices")
    if args.lora_r is not None and (args.lora_r <= 0 or args.params is not None or args.textbook
                                    or args.optimizer == "muon"):
        raise PlanError("--lora_r needs a positive rank and the model's shape (--preset or --model_name_or_path), "
                        "without --params, --textbook or --optimizer muon (train.py refuses LoRA with Muon)")
    if args.host_memory_gb is not None and not args.host_memory_gb > 0:
        raise PlanError(f"--host_memory_gb must be positive, got {args.host_memory_gb:g}")


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _gb(x: float) -> str:
    return f"{x / GB:7.2f}" if x >= 0.995e9 or x == 0 else f"{x / GB:7.3f}"


MEASURED_GAPS = ("measured on CPU (benchmarks/results/memory-2026-12-06: 113.7M parameters, 2 ranks, bf16), "
                 "the peak was ABOVE the plan (DDP +1%, FSDP2 +4-5%, ZeRO-1 +4%, ZeRO-2 +6%, ZeRO-3 +20%, ZeRO-3 "
                 "offload +22%; FSDP2 + offload 14% below)")


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


def _compute_line(shape: ModelShape, req: Request) -> str | None:
    """Memory holds every parameter, compute goes through the active ones: for a mixture of experts,
    top_k of its routed experts per token (the FLOPs train.py's MFU is measured against)."""
    fpt = shape.flops_per_token(req.seq_len)
    if fpt is None:
        return None
    tokens = req.micro_batch_size * req.seq_len
    if shape.experts:
        which = (f"{_count(shape.n_params)} total (memory: every expert is held), {_count(shape.active_params)} "
                 f"active per token (compute: top-{shape.top_k} of {shape.experts} routed experts; the activations "
                 "below are a dense block's of the same widths: the experts' own are not modelled)")
    else:
        which = f"{_count(shape.n_params)} total (memory), {_count(shape.active_params)} active per token (dense)"
    weights = (f"{_count(shape.spent_matmul_params)} matmul weights: {shape.dense_experts} runs every expert on "
               "every token" if shape.dense_experts else f"{_count(shape.active_matmul_params)} active matmul weights")
    return (f"Parameters: {which}. Compute: {fpt:.3e} FLOPs/token at seq_len {req.seq_len} (6N + each layer's "
            f"attention or recurrence, N = {weights}), {fpt * tokens:.3e} training FLOPs per GPU "
            f"per micro-batch ({tokens} tokens).")


def render(model, req: Request, rows: list[dict], model_args: str) -> str:
    shape = model if isinstance(model, ModelShape) else None
    out = []
    if shape:
        out.append(f"Memory plan for {shape.name}: {_count(shape.n_params)} parameters ({shape.layers} blocks of "
                   f"{_count(shape.block_params)}, hidden {shape.hidden}, vocab {shape.vocab}"
                   f"{', tied embeddings' if shape.tied else ''})")
        if (compute := _compute_line(shape, req)):
            out.append(compute)
        if (note := _vocab_note(shape)):
            out.append(note)
    else:
        out.append(f"Memory plan for {_count(float(model))} parameters (no shape: model states only)")
    out.append(f"{req.gpus} x {req.gpu_memory_gb:g} GB GPUs ({req.usable / GB:g} GB usable each: {req.reserve_gb:g} GB "
               f"reserved for CUDA context, NCCL, fragmentation), {req.precision}, seq_len {req.seq_len}, "
               f"micro_batch_size {req.micro_batch_size}, activation checkpointing {req.activation_checkpointing}"
               + (f", loss_chunk_size {req.loss_chunk_size}" if req.loss_chunk_size else ""))
    if req.optimizer == "muon":
        out.append(f"--optimizer muon: torch's Muon on the {_count(shape.muon_params)} hidden-matrix parameters (one "
                   "fp32 momentum each), AdamW on the rest (two); one-GPU and DDP rungs only (train.py refuses Muon "
                   "on sharded matrices)")
    if req.lora_r:
        out.append(f"--lora_r {req.lora_r}: {_count(shape.lora_params)} adapter parameters (train.py's default "
                   "targets), the only ones with gradients and optimizer states; the base's parameters frozen, "
                   "stored as the framework stores parameters. Activations are counted as for full training.")
    if req.textbook:
        out.append("Model states: ZeRO paper (fp16 mixed precision, Adam, K=12), not what the frameworks keep here. "
                   "FSDP2 rows are analogies (the paper has no FSDP): no reshard ~ ZeRO-2 (2 + 14/W: every "
                   "parameter gathered from forward to backward), full shard ~ ZeRO-3 (16/W); FSDP2 here keeps "
                   "12/W between steps and +4/W gradients. Offload rows: ZeRO-3's 16/W in CPU RAM.")
    if shape:
        probes = {regime_of(r["rung"], req.precision) for r in rows}
        secs = sum(probe_block(shape.dims, g, min(req.seq_len, PROBE_TOKENS))["seconds"] for g in probes)
        out.append(f"Activations counted on one {'Llama' if shape.llama else 'Llama-shaped'} decoder block "
                   f"under fake tensors "
                   f"({', '.join(sorted(probes))}; {min(req.seq_len, PROBE_TOKENS)} tokens, {secs:.1f} s), scaled to "
                   f"{req.micro_batch_size * req.seq_len} tokens per GPU (assumes O(seq) attention: flash/SDPA).")
    else:
        out.append("WARNING: --params gives no shape: activations, logits, buckets and parameters in flight are "
                   "UNKNOWN; 'fits' below judges model states alone and will be optimistic.")
    out.append("")
    out.append("Per GPU, GB (1 GB = 1e9 bytes). rest = between steps. peak = the largest of: forward/backward "
               "(= params + grads + optim + buffers + activ + logits), inside optimizer.step() (*), "
               "initialisation (^).")
    out.append("  params: parameters + those in flight (all-gathered / fetched) + autocast's weight copies; grads: "
               "gradients + backward buffers;")
    out.append("  activ, logits, grads: what lives at the largest moment of backward, with the gradients made by then. "
               "The head's backward: what the blocks keep, and in logits what embedding / final norm / LM head / fp32 "
               "cross-entropy keep + the logits' gradient. The first or last block's backward (logits 0: the head's "
               "are freed): what the blocks keep + the block's backward transient and recompute (with "
               "checkpointing);")
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
        out.append(f"Not an upper bound: {MEASURED_GAPS}; see tools/plan/__init__.py for what is and is not modelled.")
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
                       "peak was up to 22% above the plan). Consider activation checkpointing, a smaller "
                       "micro-batch or more GPUs.")
        out.append(f"fits: {best['rung'].config} ({best['rung'].label}) is the cheapest config that fits"
                   f"{' (tight)' if best['tight'] else ''}: peak {best['peak'] / GB:.1f} of {req.usable / GB:g} GB "
                   "usable per GPU")
        out.append(f"  {launch_line(best['rung'], req, model_args)}")
        if best["rung"].hybrid:
            out.append(f"  on every machine, with --machine_rank 0..{req.gpus // req.procs_per_node - 1} and "
                       "--main_process_ip <machine 0> (accelerate_configs/multi_node_hsdp.yaml's header)")
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
                      gpus_per_node=args.gpus_per_node, optimizer=args.optimizer, lora_r=args.lora_r,
                      gradient_accumulation_steps=args.gradient_accumulation_steps,
                      fsdp_sync_each_batch=args.fsdp_sync_each_batch == "true",
                      loss_chunk_size=args.loss_chunk_size)
        if args.params is not None:
            model, model_args = args.params, "--model_name_or_path <MODEL>"
        else:
            preset = args.preset or ("tiny" if args.model_name_or_path is None else None)
            model = model_shape(preset, args.model_name_or_path, args.lora_r)
            model_args = (f"--model_name_or_path {args.model_name_or_path}" if args.model_name_or_path
                          else f"--preset {preset}")
            if model.max_positions is not None and args.seq_len > model.max_positions:
                raise PlanError(f"--seq_len {args.seq_len} exceeds the {model.max_positions} positions of {model.name}")
        print(render(model, req, evaluate(model, req), model_args))
        return 0
    except PlanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

