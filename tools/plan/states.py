"""Model-state bytes per rung: parameters, gradients, optimizer states and framework buffers, each
term named with the source line that justifies it; the ZeRO paper's textbook numbers beside them."""

from __future__ import annotations

import functools
import json
import os

from tools.plan.ladder import CONFIG_DIR, DTYPE_BYTES, GPUS_PER_NODE, ModelShape, PlanError, Rung, get_rung


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
SRC_BUILD = "recipes/train.py:127 (common.model.build_model: from_config / from_pretrained in fp32 on the CPU)"
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
                      shape: ModelShape | None = None, textbook: bool = False,
                      gpus_per_node: int | None = None, muon_params: float = 0, lora_params: float = 0,
                      lora_largest: float = 0, fsdp_whole_gradients: bool = False) -> dict:
    """Bytes PER RANK of parameters, gradients, optimizer states and framework buffers, as the
    framework of `rung` keeps them in this repo (model built in fp32; torch AdamW, DeepSpeedCPUAdam
    under ZeRO-3 offload; accelerate defaults; the DeepSpeed JSONs in accelerate_configs/).

    precision: "bf16" | "fp16" | "fp32" (accelerate mixed_precision "no").
    shape: the model's dimensions; without it, terms that need them (bucket sizes, blocks in
    flight) are left out and named in "unknown".
    gpus_per_node: HSDP only: the GPUs of one machine, over which it shards (default
    min(world_size, 8)); every other rung shards over the whole world_size.
    muon_params: one GPU and DDP only: the parameters --optimizer muon gives torch's Muon (one fp32
    momentum buffer each, where AdamW keeps two); AdamW keeps the rest.
    lora_params: train.py's --lora_r: this many adapter parameters are added to the n_params of the
    base, stored as every parameter is, and they alone have gradients, master copies and optimizer
    states (the frozen base has none: the frameworks keep those for parameters that require grad);
    lora_largest: the largest adapter tensor.
    fsdp_whole_gradients: FSDP2 rungs: accumulation with train.py's --fsdp_sync_each_batch false, which
    keeps every trained parameter's unsharded fp32 gradient between micro-batches (by default the
    gradients are reduce-scattered every micro-batch: a shard's, as without accumulation).

    Returns a dict:
      rung, config, world_size, shard_group (the ranks one copy is sharded over), precision, n_params, textbook
      terms: list of {name, category (params|grads|optimizer|buffers), location (device|host),
             when (rest|step|in_flight|backward|optimizer_step|init), bytes, source, at_init (a "rest"
             term that already exists at the "setup" moment of initialisation), moment (init terms:
             build|setup), grows ("step" gradients created parameter by parameter as backward reaches
             them, so part of them exists at its earlier moments; DeepSpeed's are counted whole)}
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
    # S: every stored parameter (the base + the adapters); T: the trained ones (all, or the adapters alone)
    S, T = P + lora_params, float(lora_params or P)
    if lora_params and textbook:
        raise PlanError("--textbook counts full training (the ZeRO paper's 16 bytes per parameter), not LoRA")
    if rung.hybrid:  # HSDP: FSDP2 full shard within one machine, its shards replicated across machines
        W = min(world_size, gpus_per_node or GPUS_PER_NODE)
    b = DTYPE_BYTES[precision]  # compute dtype: autocast target, FSDP2 param_dtype, DeepSpeed model dtype
    terms, unknown = [], []

    def add(name, category, when, nbytes, source, location="device", at_init=False, moment=None, grows=False):
        terms.append(dict(name=name, category=category, location=location, when=when, bytes=float(nbytes),
                          source=source, at_init=at_init, moment=moment, grows=grows))

    def add_build():
        """Every rung but ZeRO-3 with zero3_init_flag: each process builds the whole model in fp32 in
        CPU RAM before accelerator.prepare moves/casts/shards it."""
        add("fp32 model built in CPU RAM by every process (before accelerator.prepare)", "params", "init", 4 * S,
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
        add("fp32 parameters", "params", "rest", 4 * S,
            "common/model.py build_model (fp32); accelerate/accelerator.py:1824-1835 (autocast wraps forward)",
            at_init=True)
        if muon_params:
            add("Muon momentum_buffer, fp32 (the hidden matrices)", "optimizer", "rest", 4 * muon_params,
                "torch/optim/_muon.py _init_group: zeros_like(grad), one state per parameter")
        add("AdamW exp_avg + exp_avg_sq, fp32" + (" (embeddings, head, norms)" if muon_params else ""), "optimizer",
            "rest", 8 * (T - muon_params), "torch/optim/adam.py _init_group: zeros_like(param) for both states")
        add_build()
        add("fp32 gradients (.grad)", "grads", "step", 4 * T,
            "autograd accumulates in the parameter dtype; zero_grad(set_to_none=True) frees them", grows=True)
        if rung.framework == "ddp":
            add("DDP reducer buckets (a second fp32 copy of every gradient)", "buffers", "rest", 4 * T,
                "torch/nn/parallel/distributed.py:731-735 (gradient_as_bucket_view=False saves nothing); "
                "accelerate/utils/dataclasses.py:188 (accelerate's default: False)", at_init=True)
    elif rung.framework == "deepspeed" and rung.stage in (1, 2):
        # DeepSpeed casts the module to bf16/fp16 (fp32 for mixed_precision "no") and takes the
        # DeepSpeedZeroOptimizer path: bf16 + stage 1 only switches to BF16_Optimizer when
        # data_types.grad_accum_dtype is fp32 (engine.py:2305-2311, 1806-1807); the JSONs set none.
        ds = zero_settings(rung.config, shape.hidden if shape else None)
        add(f"{precision} parameters, one flat buffer (bit16_groups_flat; model params are views)"
            + ("; the frozen base, cast, outside it" if lora_params else ""), "params",
            "rest", b * S, f"{SRC_DS12}:509-524, 534 (_update_model_bit16_weights)", at_init=True)
        add("fp32 master partition (single_partition_of_fp32_groups; a copy even in fp32 training)",
            "optimizer", "rest", 4 * T / W, f"{SRC_DS12}:560-577 (.clone().to(fp32))", at_init=True)
        add("AdamW exp_avg + exp_avg_sq on the fp32 partition", "optimizer", "rest", 8 * T / W,
            f"{SRC_DS12}:584 (the optimizer sees only the fp32 partition); {SRC_ADAM_LAZY}")
        add_build()
        # initialize_optimizer_states: a zero fp32 gradient for the master partition, dropped again at
        # its end without CPU offload. deepspeed 0.19.8 runs no optimizer step here (older versions
        # did, creating Adam's states at init): they appear at the first real step.
        add("zero fp32 gradient of the master partition (initialize_optimizer_states; freed at its end)", "grads",
            "init", 4 * T / W, f"{SRC_DS12}:934-951 (called at :734)", moment="setup")
        add(f"gradient partition, {precision} (grads_in_partition)", "grads", "step", b * T / W,
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
            add("full-size gradients until the end-of-backward reduction", "grads", "backward", b * T * (1 - 1 / W),
                f"{SRC_DS12}:2284-2295")
        elif rung.stage == 1 and ds["reduce_bucket_size"] is not None and shape is not None:
            # With overlap_comm gradients are reduced through the buckets as they arrive, but a
            # parameter larger than a bucket keeps its own gradient (:1443-1449), and ZeRO-1 frees
            # the other ranks' ones only at the end of backward (:2271-2273; ZeRO-2 at once, :2262-2268).
            # Measured (small preset, fp32, 2 CPU ranks): +1.15/+1.49 bytes/param over ZeRO-2.
            large = 0 if lora_params else sum(n for n in shape.param_numels if n > ds["reduce_bucket_size"])
            add("gradients of parameters larger than a bucket, kept until the end of backward", "grads", "backward",
                b * large * (1 - 1 / W), f"{SRC_DS12}:1443-1449, 2271-2273")
        elif rung.stage == 1:
            unknown.append("ZeRO-1 gradients of parameters larger than a bucket")
        # step(): flatten the partition's gradients (a copy) and cast it to fp32 (another copy
        # unless already fp32); both alive at the cast.
        add("flattened gradient partition + its fp32 copy inside step()", "grads", "optimizer_step",
            (b + 4) * T / W if b != 4 else 4 * T / W, f"{SRC_DS12}:3108-3126")
    elif rung.framework == "deepspeed":  # ZeRO-3
        ds = zero_settings(rung.config, shape.hidden if shape else None)
        off = "host" if rung.offload else "device"
        add(f"{precision} parameter partitions", "params", "rest", b * S / W,
            f"{SRC_DS3}:968-973 (lp_param_buffer); offload_param: pinned CPU buffer :977-998, :888-911", off,
            at_init=True)
        # Always a separate copy, even in fp32: the reuse branch (:1162-1167) compares the partition's
        # torch.device with the device *name* string (self.device, :333), which is never equal.
        # Measured (small preset, fp32, 2 CPU ranks): 10.34 bytes/param at rest = 20.7/W.
        add("fp32 master partition (a copy, even in fp32 training)", "optimizer", "rest", 4 * T / W,
            f"{SRC_DS3}:1156-1160, 1168-1172 (.clone())", off, at_init=True)
        add("Adam exp_avg + exp_avg_sq, fp32" + (" (DeepSpeedCPUAdam)" if rung.offload else ""), "optimizer", "rest",
            8 * T / W, "deepspeed/ops/adam/cpu_adam.py:158-164 (created at the first step)" if rung.offload
            else f"torch AdamW on the fp32 partition; {SRC_ADAM_LAZY}", off)
        add(f"gradient partitions, {precision} (grad_partitions_flat_buffer, allocated once)", "grads", "rest",
            b * T / W, f"{SRC_DS3}:789-795 (on self.device: the CPU with optimizer offload, :333; allocated after "
                       "initialize_optimizer_states, :772)", off)
        if rung.offload:
            add("fp32 gradient buffer of the CPU optimizer (pinned)", "grads", "rest", 4 * T / W,
                f"{SRC_DS3}:1337-1342", "host", at_init=True)
        else:
            # step(): flatten (copy) + cast to fp32 per sub-group (sub_group_size elements at most).
            part = min(T / W, ds["sub_group_size"])
            add("flattened gradient partition + its fp32 copy inside step()", "grads", "optimizer_step",
                (b + 4) * part if b != 4 else 4 * part, f"{SRC_DS3}:2683-2694")
        # initialize_optimizer_states: an fp32 gradient buffer of the largest sub-group's partition on
        # self.device (the CPU with optimizer offload), dropped at its end (without offload the
        # sub-groups' .grad are reset to None, :1366-1368); no optimizer step in deepspeed 0.19.8.
        add("fp32 gradient buffer of the largest sub-group (initialize_optimizer_states; freed at its end)", "grads",
            "init", 4 * min(T / W, ds["sub_group_size"]), f"{SRC_DS3}:1301-1306 (called at :772)", off,
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
                b * (lora_largest if lora_params else max(shape.param_numels)),
                f"{SRC_DS3}:2006-2050 (partition_grads)")
    else:  # FSDP2 (HSDP: the same terms over one machine's GPUs; the all-reduce across machines runs in
        # place on the reduce-scatter output, _fsdp_collectives.py:657-662: no buffer of its own)
        off = "host" if rung.offload else "device"
        # The model is built in fp32; MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
        # (fsdp_full_shard.py, train_extras/parallel/fsdp_settings.py) only changes the all-gathered copies:
        # shards, their grads and the AdamW states stay fp32. CPUOffloadPolicy keeps all three in CPU RAM.
        add("fp32 parameter shards (DTensor)", "params", "rest", 4 * S / W,
            f"{SRC_FSDP}/_fsdp_param.py:298-318 (padded shard in the original dtype; offload: .cpu())", off,
            at_init=True)
        add("AdamW exp_avg + exp_avg_sq on the shards", "optimizer", "rest", 8 * T / W,
            f"{SRC_ADAM_LAZY} (states on the shard's device)", off)
        add_build()
        if fsdp_whole_gradients:
            add("unsharded fp32 gradients kept between micro-batches (--fsdp_sync_each_batch false)", "grads",
                "step", 4 * T, f"{SRC_FSDP}/_fsdp_param_group.py:607-612 (post_backward without reduce_grads: "
                               "to_accumulated_grad_if_needed); on the GPU beside the unsharded parameters, "
                               "also with CPU offload")
        add("fp32 gradient shards", "grads", "step", 4 * T / W,
            f"{SRC_FSDP}/_fsdp_collectives.py:686-710 (views of the fp32 reduce-scatter output; offload: copied to "
            "CPU)",
            off, grows=True)
        if shape is None:
            unknown += ["unsharded parameters in flight", "unsharded gradients + reduce-scatter input",
                        "one unit's parameters moved whole to the GPU at init"]
        else:
            if rung.reshard:
                # Current block + the prefetched one, plus the tail unit [final norm, lm_head] (with
                # tied weights [final norm, embedding = lm_head]) that accelerate shards with
                # reshard_after_forward=False: unsharded from the end of forward to the start of
                # backward, the peak moment.
                in_flight = 2 * (shape.block_params + lora_params / shape.layers) + shape.tail_params
                why = ("two blocks (current + prefetched) + the tail [final norm, "
                       + ("tied embedding/lm_head]" if shape.tied else "lm_head]"))
            else:
                in_flight = S  # every unit stays gathered from its forward to its backward
                why = "every unit, held from its forward to its backward"
            add(f"all-gathered parameters in {precision}: {why}", "params", "in_flight", b * in_flight,
                f"{SRC_FSDP}/_fsdp_param.py:630-680 (unsharded params), accelerate/utils/fsdp_utils.py:857-878")
            unit = max(shape.block_params, shape.tail_params, 0 if shape.tied else shape.embed_params)
            unit_grads = lora_params / shape.layers if lora_params else unit  # a block's adapters
            add(f"one unit's unsharded {precision} gradients + fp32 reduce-scatter input", "grads", "backward",
                (b + 4) * unit_grads, f"{SRC_FSDP}/_fsdp_collectives.py:592-605")
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
        rung=rung.name, config=rung.config, world_size=world_size, shard_group=W, precision=precision, n_params=P,
        lora_params=lora_params, textbook=textbook,
        terms=terms, unknown=unknown,
        at_rest={loc: total(("rest",), loc) for loc in ("device", "host")},
        at_step={loc: total(("rest", "step"), loc) for loc in ("device", "host")},
        transient={w: sum(t["bytes"] for t in terms if t["when"] == w) for w in TRANSIENTS},
        at_init={loc: at_init(loc) for loc in ("device", "host")},
    )


