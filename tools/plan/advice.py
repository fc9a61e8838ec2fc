"""The plan: one row per rung (rest, peak, host RAM, fits), the cheapest config that fits with its
launch line, and, when nothing fits, what would (more GPUs, offload, checkpointing, smaller batches)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from dataclasses import dataclass

from tools.plan.ladder import GB, GPUS_PER_NODE, LADDER, MAX_GPUS, ModelShape, Rung, ladder
from tools.plan.activations import CHECKPOINTING, activation_bytes, regime_of
from tools.plan.states import model_state_bytes


@dataclass(frozen=True)
class Request:
    gpus: int = 1
    gpu_memory_gb: float = 80.0
    precision: str = "bf16"
    seq_len: int = 256
    micro_batch_size: int = 16
    activation_checkpointing: str = "none"  # none | full | selective (a bool: full or none)
    textbook: bool = False
    reserve_gb: float = 2.0
    host_memory_gb: float | None = None  # CPU RAM per machine; None: host RAM is not checked
    gpus_per_node: int | None = None  # GPUs per machine (None: 8); processes per machine = min(gpus, this)
    optimizer: str = "adamw"  # "muon": train.py's --optimizer muon (one GPU or DDP only)
    lora_r: int | None = None  # train.py's --lora_r: the model's shape then holds its adapters' count
    gradient_accumulation_steps: int = 1
    fsdp_sync_each_batch: bool = True  # train.py's: False keeps FSDP2's whole gradient between micro-batches
    loss_chunk_size: int = 0  # train.py's --loss_chunk_size: the head's logits a chunk at a time

    def __post_init__(self):
        object.__setattr__(self, "activation_checkpointing", CHECKPOINTING[self.activation_checkpointing])

    @property
    def usable(self) -> float:
        return (self.gpu_memory_gb - self.reserve_gb) * GB

    @property
    def procs_per_node(self) -> int:
        return min(self.gpus, self.gpus_per_node or GPUS_PER_NODE)


MUON_FRAMEWORKS = ("single", "ddp")  # whole matrices on every rank (train_extras/muon.py check_launch)
TIGHT = 0.9  # a peak above this share of the usable GPU memory is printed "tight"


def grads_done(shape: ModelShape, head: bool, blocks: int, lora: bool = False) -> float:
    """The share of the trained parameters whose gradients exist once backward has run the head (or
    not) and `blocks` blocks: the tail [final norm, lm_head] first (with tied weights the shared
    embedding), block by block from the last, the untied input embedding at the very end. LoRA: the
    adapters sit in the blocks alone (train_extras/lora.py targets their linear layers)."""
    if lora:
        return blocks / shape.layers
    n = shape.n_params
    per_block = (n - shape.tail_params - (0 if shape.tied else shape.embed_params)) / shape.layers
    return (head * shape.tail_params + blocks * per_block) / n


def backward_moments(states: dict, act: dict | None, shape: ModelShape | None, accumulation: int) -> dict:
    """The columns of the peak (params, grads, optimizer, buffers, activations, logits) at each moment
    of backward activation_bytes names: the head's (every block's activations, the logits and their
    gradient), the first block's and the last block's (the head's tensors freed, a block's recompute
    and backward transient). Gradients that grow (the terms marked so: .grad under DDP and one GPU,
    FSDP2's shards) count only where backward has made them: those of the units done, and the share
    of the moment's own unit made by each point of its probed curve. With accumulation every
    micro-batch after the first finds them all, and the unit's fresh ones (added into them) come on
    top: on one GPU and DDP autograd adds each fresh .grad in and frees it at once, so this
    over-counts there by up to one unit's gradients, on the safe side. Without a shape: one moment,
    every gradient, no activations."""
    dev, tr = states["at_step"]["device"], states["transient"]
    growing = sum(t["bytes"] for t in states["terms"] if t["grows"] and t["location"] == "device")
    lora = bool(states["lora_params"])

    def columns(done=1.0, fresh=0.0, weight_copies=0.0, activations=0.0, logits=0.0):
        made = growing * fresh if accumulation > 1 else -growing * (1 - done)
        return dict(params=dev["params"] + tr["in_flight"] + weight_copies,
                    grads=dev["grads"] + made + tr["backward"], optimizer=dev["optimizer"],
                    buffers=dev["buffers"], activations=activations, logits=logits)

    if act is None:
        return {"backward": columns()}
    moments = {}
    for name, m in act["moments"].items():
        head, blocks = m["done"]
        done = grads_done(shape, head, blocks, lora)
        unit = grads_done(shape, *((True, blocks) if m["unit"] == "head" else (head, blocks + 1)), lora) - done
        points = []
        for transient, share in m["curve"]:
            alive = dict(activations=m["activations"], logits=m["logits"])
            alive[m["column"]] += transient
            points.append(columns(done + unit * share, unit * share, m["weight_copies"], **alive))
        moments[name] = max(points, key=lambda c: sum(c.values()))
    return moments


def evaluate(model: ModelShape | float, req: Request) -> list[dict]:
    """One row per rung, bytes per GPU (per process for host). Keys:
    rung, states (model_state_bytes), activations (activation_bytes or None), columns (the peak's
    composition: params, grads, optimizer, buffers, activations, logits, at `moment`, the largest of
    `moments`: backward_moments), rest, peak (the largest of
    the three candidates), candidates {forward_backward, optimizer_step, init}, peak_at (which one),
    peak_in_step, host (CPU RAM per process after backward: offload), host_init (CPU RAM per process
    while the run starts), host_per_node (max(host, host_init) x processes per machine),
    host_fits (None when host RAM is not checked), gpu_fits, fits (bool: GPU and host), tight
    (fits, but the peak is above TIGHT x the usable GPU memory)."""
    shape = model if isinstance(model, ModelShape) else None
    n_params = shape.n_params if shape else float(model)
    rows = []
    for rung in ladder(req.gpus, req.gpus_per_node):
        if req.optimizer == "muon" and rung.framework not in MUON_FRAMEWORKS:
            continue  # train.py refuses Muon where the matrices are sharded
        states = model_state_bytes(rung, n_params, req.gpus, req.precision, shape, req.textbook, req.gpus_per_node,
                                   muon_params=shape.muon_params if shape and req.optimizer == "muon" else 0,
                                   lora_params=shape.lora_params if shape and req.lora_r else 0,
                                   lora_largest=shape.lora_largest if shape and req.lora_r else 0,
                                   fsdp_whole_gradients=req.gradient_accumulation_steps > 1
                                   and not req.fsdp_sync_each_batch)
        dev, tr = states["at_step"]["device"], states["transient"]
        act = (activation_bytes(shape, regime_of(rung, req.precision), req.seq_len, req.micro_batch_size,
                                req.activation_checkpointing, req.loss_chunk_size) if shape else None)
        moments = backward_moments(states, act, shape, req.gradient_accumulation_steps)
        moment = max(moments, key=lambda m: sum(moments[m].values()))  # ties: the earliest
        cols = moments[moment]
        candidates = dict(forward_backward=sum(cols.values()), optimizer_step=dev["total"] + tr["optimizer_step"],
                          init=states["at_init"]["device"]["total"])
        peak_at = max(candidates, key=candidates.get)  # ties: forward_backward (listed first)
        peak = candidates[peak_at]
        host, host_init = states["at_step"]["host"]["total"], states["at_init"]["host"]["total"]
        host_per_node = max(host, host_init) * req.procs_per_node
        host_fits = None if req.host_memory_gb is None else host_per_node <= req.host_memory_gb * GB
        gpu_fits = peak <= req.usable
        fits = gpu_fits and host_fits is not False
        rows.append(dict(rung=rung, states=states, activations=act, columns=cols, moment=moment, moments=moments,
                         rest=states["at_rest"]["device"]["total"], peak=peak, candidates=candidates, peak_at=peak_at,
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
    if rung.hybrid:  # the mesh: one replica per machine, sharded over its GPUs
        machines = req.gpus // req.procs_per_node
        parts[2:2] = [f"--num_machines {machines}"]
        parts += [f"--parallelism_config_dp_replicate_size {machines}",
                  f"--parallelism_config_dp_shard_size {req.procs_per_node}"]
    if req.precision != "bf16" and rung.framework == "deepspeed":
        # Its JSON enables bf16 and --mixed_precision cannot override that: a copy of the JSON says the precision.
        parts.append(f"--deepspeed_config_file my_{Path(rung.config).stem}.json")
    elif req.precision != "bf16":  # every other config in the ladder says bf16
        parts.append(f"--mixed_precision {'no' if req.precision == 'fp32' else 'fp16'}")
    if req.activation_checkpointing == "full" and rung.framework == "fsdp":
        parts.append("--fsdp_activation_checkpointing true")  # the configs' advice: FSDP's own switch
    parts += ["recipes/train.py", model_args, f"--seq_len {req.seq_len}", f"--micro_batch_size {req.micro_batch_size}"]
    if req.optimizer == "muon":
        parts.append("--optimizer muon")
    if req.lora_r:
        parts.append(f"--lora_r {req.lora_r}")
    if req.gradient_accumulation_steps > 1:
        parts.append(f"--gradient_accumulation_steps {req.gradient_accumulation_steps}")
    if not req.fsdp_sync_each_batch and rung.framework == "fsdp":
        parts.append("--fsdp_sync_each_batch false")
    if req.activation_checkpointing == "selective" or (req.activation_checkpointing == "full"
                                                       and rung.framework != "fsdp"):
        parts.append(f"--gradient_checkpointing {'true' if req.activation_checkpointing == 'full' else 'selective'}")
    if req.loss_chunk_size:
        parts.append(f"--loss_chunk_size {req.loss_chunk_size}")
    line = " ".join(parts)
    if req.precision != "bf16" and rung.framework == "deepspeed":
        name, fp16 = Path(rung.config).stem, "true" if req.precision == "fp16" else "false"
        line += (f"\n    (my_{name}.json: a copy of accelerate_configs/{name}.json with "
                 f"\"bf16\": {{\"enabled\": false}}, \"fp16\": {{\"enabled\": {fp16}}})")
    return line


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
    # Checkpointing, the cheaper recompute first: selective, then every block.
    ac_works = None
    if req.activation_checkpointing == "none":
        ac_works = report("selective activation checkpointing",
                          dataclasses.replace(req, activation_checkpointing="selective"))
    if req.activation_checkpointing != "full" and not ac_works:
        ac_works = report("activation checkpointing (every block)",
                          dataclasses.replace(req, activation_checkpointing="full"))

    def smaller(r: Request, micro: int) -> Request:  # the same batch in more micro-batches
        k = math.ceil(r.micro_batch_size / micro) * r.gradient_accumulation_steps
        return dataclasses.replace(r, micro_batch_size=micro, gradient_accumulation_steps=k)

    def largest_micro(r: Request) -> int | None:
        return next((m for m in range(r.micro_batch_size - 1, 0, -1) if cheapest(evaluate(model, smaller(r, m)))),
                    None)

    micro = largest_micro(req) if req.micro_batch_size > 1 else None
    if micro:
        k = math.ceil(req.micro_batch_size / micro)
        report(f"micro_batch_size {micro} (with --gradient_accumulation_steps {k}: at least the same batch)",
               smaller(req, micro))
    elif req.micro_batch_size > 1:
        lines.append("  - smaller micro-batch: not even micro_batch_size 1 fits")
    if not (ac_works or micro or req.activation_checkpointing == "full"):  # neither lever alone: both together
        both = dataclasses.replace(req, activation_checkpointing="full")
        if (micro := largest_micro(both)):
            report(f"activation checkpointing + micro_batch_size {micro}", smaller(both, micro))
        else:
            report("activation checkpointing + micro_batch_size 1", dataclasses.replace(both, micro_batch_size=1))
    return lines


