"""Test-only probes, loaded into every process a test launches (this folder is first on PYTHONPATH,
so Python imports this file as `sitecustomize` before the recipe). No recipe imports anything from
here: the probes patch accelerate, transformers and `os` from the outside, so a recipe copied out of
the repository is probed the same way.

With ACCELERATE_RECIPES_PROBE_DIR set, each rank appends JSON lines to <dir>/rank<r>.jsonl:
  {"batch": [...]}           the sample ids of every training micro-batch this rank consumed
  {"memory": {...}}          memory in use before the model is built and around the second step
  {"ddp_buckets": [...]}     DDP gradient buckets all-reduced per micro-step of the first optimizer
                             step (ACCELERATE_RECIPES_PROBE_DDP_BUCKETS=1)
  {"gradient_bytes": {...}}  after each backward of the first optimizer step, the gradient bytes this
                             rank holds, sharded and (FSDP2, sync off) unsharded
                             (ACCELERATE_RECIPES_PROBE_GRADIENT_BYTES=1)
  {"syncs": {...}}           per optimizer step, the calls that make a GPU wait for its queue (`.item()`,
                             `.tolist()`, `bool`/`float`/`int` of a tensor, `.cpu()`, `.numpy()`,
                             `.nonzero()`, a copy to the host) since the previous step, counted by call
                             site: the first caller outside torch (ACCELERATE_RECIPES_PROBE_SYNCS=1)
  {"applied_gradient": {...}} with a GradScaler (fp16), per optimizer step: the norm of the gradient
                             the optimizer really applies (unscaled, clipped), or that it skipped it
  {"teardown": true}         the interpreter's teardown ran (atexit): train.py's several-process runs
                             end without it (train_extras/resume/preemption.without_teardown)
  {"final": {...}}           at end_training: peak memory, what the strategy built, parameter sharding, optimizer
                             groups, the model's class, tied embeddings, tensor-parallel or HSDP
                             layout and replica drift, routers' correction biases, and fp32 logits of the
                             trained model on PROBE_INPUT_IDS
With ACCELERATE_RECIPES_FAULT=<phase>@<step>, the main process stops dead (os._exit, like a kill -9
or a node loss) at that phase of that step's checkpoint save:
  after_shard      its part of save_state is written; the other ranks may still be writing
  during_metadata  checkpoint.json half written (its temporary file, never renamed)
  before_rename    everything written and synced, not yet renamed to step_<N>
  during_rotation  an old checkpoint moved aside and partly deleted
With ACCELERATE_RECIPES_FAULT=export_<phase>, the main process stops dead at that moment of the
Hugging Face export (common/export.py writes `.model.partial` beside `model`, then swaps it in), seen
from transformers' writers, os.fsync, os.rename and shutil.rmtree:
  export_mid_weights      half of model.safetensors written
  export_after_weights    the model's save_pretrained done (weights, config), no tokenizer yet
  export_after_tokenizer  the tokenizer written, the final config not yet
  export_before_swap      every file and the folder synced, not yet in place
  export_set_aside        (where the swap is two renames) the old export renamed aside, the new not yet in
  export_after_swap       the new export in place, the old one not yet removed
  export_removing_old     the old export half removed
With ACCELERATE_RECIPES_CPUINFO_CACHE=<file>, py-cpuinfo's get_cpu_info() is answered from that
file, which the session's first call writes: DeepSpeed calls it three times per rank while it starts
(CPU Adam and its op builders), each a ~3.5 s subprocess that times the CPU's clock, which made up a
third of a 2-rank ZeRO-3 offload launch on 2 cores. The answer is this machine's, so nothing changes
but the wait.
With ACCELERATE_RECIPES_DISK_FULL_AT=step_<N>, saving model weights into that step's checkpoint
writes half the file and fails with ENOSPC (for machines where a test cannot mount a small tmpfs);
=model: the same for the weights of the Hugging Face export (written into `.model.partial`).
With ACCELERATE_RECIPES_SLOW_DATA=<seconds>, rank 0's first datasets.map (its tokenising on first
use) sleeps that long first: a corpus that takes longer to prepare than a collective may wait.
With ACCELERATE_RECIPES_SLOW_EVAL=<seconds>, once the model has trained (a forward in training mode),
every forward of it in eval mode (each held-out batch, each generated token) sleeps that long first:
an eval or a sample that lasts minutes, as a big model's does (an eval before the first step, step 0's
or a resumed run's, keeps its pace).
With probes on, a streamed training loader's rows are recorded by content: {"stream_rows": [...]}.
The CPU harness (scripts/cpu_harness) is chained when ACCELERATE_RECIPES_CPU_HARNESS=1.
"""

import atexit
import json
import os
import re
import runpy
import sys
import time
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROBE_DIR = os.environ.get("ACCELERATE_RECIPES_PROBE_DIR")
FAULT = os.environ.get("ACCELERATE_RECIPES_FAULT")
FAULT_EXIT_CODE = 86
FAULT_PHASES = ("after_shard", "during_metadata", "before_rename", "during_rotation")
EXPORT_FAULT_PHASES = ("export_mid_weights", "export_after_weights", "export_after_tokenizer", "export_before_swap",
                       "export_set_aside", "export_after_swap", "export_removing_old")
PROBE_INPUT_IDS = list(range(10, 18))  # valid ids for every tokenizer the tests use (>= 259 entries)

if os.environ.get("ACCELERATE_RECIPES_CPU_HARNESS") == "1":
    runpy.run_path(str(HERE.parents[1] / "scripts" / "cpu_harness" / "sitecustomize.py"))

_seen = {"model": None, "optimizer": None, "train_dataset": None, "optimizer_steps": 0}


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def record(key: str, value) -> None:
    """Append one line to this rank's file; the first line of a process starts the file afresh (a
    resumed run in the same output folder records only itself)."""
    mode = "a" if _seen.get("recorded") else "w"
    _seen["recorded"] = True
    with open(Path(PROBE_DIR) / f"rank{_rank()}.jsonl", mode) as f:
        f.write(json.dumps({key: value}) + "\n")


def _teardown():
    """At exit: the teardown ran. Only in a process that recorded something: a helper Python process
    (DeepSpeed building its CPU Adam) inherits this rank's environment, and its first record would
    start the rank's file afresh, wiping what the recipe recorded."""
    if _seen.get("recorded"):
        record("teardown", True)


def _install_probes():
    import torch
    from accelerate import Accelerator
    from accelerate.data_loader import DataLoaderShard
    from accelerate.optimizer import AcceleratedOptimizer
    from torch.utils.data import DataLoader, IterableDataset, SequentialSampler
    from transformers import AutoModelForCausalLM

    import facts

    Path(PROBE_DIR).mkdir(parents=True, exist_ok=True)
    atexit.register(_teardown)

    prepare = Accelerator.prepare

    def probed_prepare(self, *args, **kwargs):
        out = prepare(self, *args, **kwargs)
        results = out if isinstance(out, (tuple, list)) and len(args) > 1 else (out,)
        for arg, result in zip(args, results):
            if isinstance(arg, torch.nn.Module) and _seen["model"] is None:
                _seen["model"] = result
            elif isinstance(arg, torch.optim.Optimizer) and _seen["optimizer"] is None:
                _seen["optimizer"] = result
            elif isinstance(arg, DataLoader) and _seen["train_dataset"] is None and not isinstance(
                    arg.sampler, SequentialSampler):  # the held-out loader is the one in order
                _seen["train_dataset"] = arg.dataset
            elif isinstance(arg, torch.optim.lr_scheduler.LRScheduler) and _seen["optimizer"] is None:
                _seen["optimizer"] = arg.optimizer  # train.py's TP route prepares the schedule only
        buckets = os.environ.get("ACCELERATE_RECIPES_PROBE_DDP_BUCKETS") == "1"
        if buckets and hasattr(_seen["model"], "register_comm_hook"):
            _count_ddp_buckets(_seen["model"])
        if os.environ.get("ACCELERATE_RECIPES_PROBE_GRADIENT_BYTES") == "1" and not _seen.get("gradient_bytes"):
            _seen["gradient_bytes"] = True
            _record_gradient_bytes()
        if getattr(_seen["optimizer"], "scaler", None) is not None and not _seen.get("applied_gradient"):
            _seen["applied_gradient"] = True
            _record_applied_gradients(_seen["optimizer"].optimizer)
        return out

    Accelerator.prepare = probed_prepare

    unwrap = Accelerator.unwrap_model

    def probed_unwrap(self, model, *args, **kwargs):  # train.py's TP route never passes its model to prepare
        if _seen["model"] is None and isinstance(model, torch.nn.Module):
            _seen["model"] = model
        return unwrap(self, model, *args, **kwargs)

    Accelerator.unwrap_model = probed_unwrap
    # The recipes unwrap through common/export.py's own unwrap (accelerate's imports deepspeed), which
    # calls accelerate's only under DeepSpeed: catch the model where train.py samples from it and
    # exports it. (Not by importing common here: a copied recipe must import its own copy.)
    from transformers import GenerationMixin, PreTrainedModel

    def catching(method):  # the last model seen there, used only when prepare saw none (a recipe may save
        def probed(self, *args, **kwargs):  # a random-init model first, to reload it with a TP plan)
            _seen["caught_model"] = self
            return method(self, *args, **kwargs)
        return probed

    GenerationMixin.generate = catching(GenerationMixin.generate)
    PreTrainedModel.save_pretrained = catching(PreTrainedModel.save_pretrained)

    iterate = DataLoaderShard.__iter__

    def probed_iter(self):
        for batch in iterate(self):
            if self.dataset is _seen["train_dataset"] and isinstance(batch, dict) and "index" in batch:
                record("batch", batch["index"].tolist())
            yield batch

    DataLoaderShard.__iter__ = probed_iter

    # a streamed training loader stays a plain DataLoader (train.py does not prepare it): its rows
    # by content (crc32 of the input ids), read as the rank reads them, skipped ones included
    plain_iter = DataLoader.__iter__

    def probed_plain_iter(self):
        batches = plain_iter(self)
        if not isinstance(self.dataset, IterableDataset) or isinstance(self, DataLoaderShard):
            return batches
        return ((record("stream_rows", [zlib.crc32(row.numpy().tobytes()) for row in batch["input_ids"]])
                 if isinstance(batch, dict) else None, batch)[1]  # (not the tokenising workers' documents)
                for batch in batches)

    DataLoader.__iter__ = probed_plain_iter

    # memory: before the (real, not meta) model is built, then around the second optimizer step
    for name in ("from_config", "from_pretrained"):
        build = getattr(AutoModelForCausalLM, name).__func__

        def probed_build(cls, *args, _build=build, **kwargs):
            if "before_model" not in _seen and torch.get_default_device().type != "meta":
                _seen["before_model"] = True
                record("memory", {"before_model": facts.memory_in_use(torch.device("cpu"))})
            return _build(cls, *args, **kwargs)

        setattr(AutoModelForCausalLM, name, classmethod(probed_build))

    for cls in {AcceleratedOptimizer, *AcceleratedOptimizer.__subclasses__()}:
        _probe_steps(cls, facts)

    end = Accelerator.end_training

    def probed_end(self):
        record("final", _final_facts(self, facts))
        return end(self)

    Accelerator.end_training = probed_end


def _probe_steps(cls, facts):
    import torch

    step, zero_grad = cls.step, cls.zero_grad

    def probed_step(self, *args, **kwargs):
        _seen["optimizer_steps"] += 1
        if _seen.get("syncs") is not None:  # what the step did (its micro-batches, its clipping) until here
            record("syncs", {"step": _seen["optimizer_steps"], "sites": dict(sorted(_seen["syncs"].items()))})
            _seen["syncs"].clear()
        if _seen["optimizer_steps"] == 2:  # activations freed, gradients held (DeepSpeed: already stepped)
            record("memory", {"after_backward": facts.memory_in_use(torch.device("cpu"))})
        return step(self, *args, **kwargs)

    def probed_zero_grad(self, *args, **kwargs):
        out = zero_grad(self, *args, **kwargs)
        if _seen["optimizer_steps"] == 2 and "after_step" not in _seen:  # at rest between steps
            _seen["after_step"] = True
            record("memory", {"after_step": facts.memory_in_use(torch.device("cpu"))})
        return out

    cls.step, cls.zero_grad = probed_step, probed_zero_grad


def _count_host_syncs():
    """Counts each call that, on a GPU, waits for the device (the census of docs/benchmarks.md#host-syncs-per-step),
    by its site: the first frame outside torch and these probes (`recipes/train.py:530`,
    `transformers/masking_utils.py:...`). On a CPU nothing waits, but the calls are the same."""
    import torch

    counts = _seen["syncs"] = {}
    torch_dir = str(Path(torch.__file__).parent)

    def count(what: str, depth: int = 3) -> None:
        where = site(depth)
        if where is not None:
            counts[f"{where} {what}"] = counts.get(f"{where} {what}", 0) + 1

    def site(depth: int) -> str | None:
        frame = sys._getframe(depth)
        while frame is not None and (frame.f_code.co_filename.startswith(torch_dir)
                                     or frame.f_code.co_filename.endswith("/warnings.py")):
            frame = frame.f_back
        if frame is None or frame.f_code.co_filename == __file__:
            return None  # the probes' own reads are not the run's
        name = frame.f_code.co_filename
        name = name.split("site-packages/")[-1] if "site-packages/" in name else "/".join(Path(name).parts[-2:])
        return f"{name}:{frame.f_lineno}"

    def counted(method, what):
        def wrapped(self, *args, **kwargs):
            count(what)
            return method(self, *args, **kwargs)
        return wrapped

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy", "nonzero"):
        setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name), name))
    to = torch.Tensor.to

    def counted_to(self, *args, **kwargs):  # a copy to the host, or one from it without non_blocking
        target = next((a for a in (*args, kwargs.get("device")) if isinstance(a, (str, torch.device))), None)
        if target is not None and torch.device(target).type != self.device.type and not kwargs.get("non_blocking"):
            count(f"to({torch.device(target).type})")
        return to(self, *args, **kwargs)

    torch.Tensor.to = counted_to
    import accelerate.data_loader

    send = accelerate.data_loader.send_to_device

    def counted_send(batch, device, non_blocking=False, **kwargs):  # a batch copied to the device
        if not non_blocking:
            count("blocking batch copy")
        return send(batch, device, non_blocking=non_blocking, **kwargs)

    accelerate.data_loader.send_to_device = counted_send
    if torch.cuda.is_available():  # and what CUDA itself sees wait (the GPU check): each at its site
        import warnings

        torch.cuda.set_sync_debug_mode("warn")
        warnings.filterwarnings("always", message=".*called a synchronizing CUDA operation")
        show = warnings.showwarning

        def counted_warning(message, category, filename, lineno, *args, **kwargs):
            if "synchronizing CUDA operation" in str(message):
                count("cuda sync")
            else:
                show(message, category, filename, lineno, *args, **kwargs)

        warnings.showwarning = counted_warning


def _record_applied_gradients(optimizer):
    """Before each step of the optimizer that really steps (under a GradScaler): the norm of the
    gradient it applies. A fused optimizer is handed the scaler's grad_scale (what its kernel still
    divides by; unset when unscale_ already ran) and found_inf (its kernel then skips the step); a
    plain one is not called at all on a skipped step."""
    import torch

    def before_step(opt, args, kwargs):
        found_inf, grad_scale = getattr(opt, "found_inf", None), getattr(opt, "grad_scale", None)
        if found_inf is not None and found_inf.item() > 0:
            record("applied_gradient", {"skipped": True, "norm": None})
            return
        grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads).item() / (1.0 if grad_scale is None else grad_scale.item())
        record("applied_gradient", {"skipped": False, "norm": norm})

    optimizer.register_step_pre_hook(before_step)


def _count_ddp_buckets(model):
    """Which gradient buckets each micro-step of the first optimizer step all-reduced (DDP's default
    all-reduce, plus a note of the bucket)."""
    from accelerate import Accelerator
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    reduced = []

    def counting_allreduce(state, bucket):
        reduced.append([bucket.index(), bucket.buffer().numel()])
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_allreduce)
    backward = Accelerator.backward

    def probed_backward(self, loss, **kwargs):
        out = backward(self, loss, **kwargs)
        if _seen["optimizer_steps"] == 0:
            record("ddp_buckets", list(reduced))
        reduced.clear()
        return out

    Accelerator.backward = probed_backward


def _record_gradient_bytes():
    """After each backward of the first optimizer step, the bytes of gradient this rank holds: its
    parameters' .grad (a DTensor's local shard) and, under FSDP2, the unsharded gradients it keeps
    accumulating between micro-batches while gradient sync is off (an FSDPParam's unsharded
    parameter's .grad, or its unsharded_accumulated_grad when that is kept in the reduce dtype)."""
    from accelerate import Accelerator

    backward = Accelerator.backward

    def held(model) -> dict:
        sharded = unsharded = 0
        for p in model.parameters():
            if p.grad is not None:
                local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                sharded += local.numel() * local.element_size()
        groups = {}  # (fully_shard([norm, lm_head]) gives both modules one state: each group once)
        for module in model.modules():
            state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
            groups |= {id(group): group for group in getattr(state, "_fsdp_param_groups", None) or []}
        for group in groups.values():
            for fsdp_param in group.fsdp_params:  # (in the reduce dtype, or as autograd left it)
                plain = getattr(getattr(fsdp_param, "_unsharded_param", None), "grad", None)
                for grad in (fsdp_param.unsharded_accumulated_grad, plain):
                    unsharded += 0 if grad is None else grad.numel() * grad.element_size()
        return {"grad": sharded, "unsharded_accumulated": unsharded}

    def probed_backward(self, loss, **kwargs):
        out = backward(self, loss, **kwargs)
        if _seen["optimizer_steps"] == 0 and _seen["model"] is not None:
            record("gradient_bytes", {"sync": self.sync_gradients, **held(_seen["model"])})
        return out

    Accelerator.backward = probed_backward


def _final_facts(accelerator, facts) -> dict:
    """Called on every rank (some of these are collectives under sharding)."""
    import torch

    import resource

    model, optimizer = _seen["model"] or _seen.get("caught_model"), _seen["optimizer"]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    out = {"peak_memory": {"cpu_max_rss_bytes": rss}}
    if accelerator.device.type == "cuda":
        out["peak_memory"]["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(accelerator.device)
    if model is None:  # the pipeline recipe trains stages it never gives to accelerate
        return out
    unwrapped = accelerator.unwrap_model(model, keep_fp32_wrapper=False)  # without the autocast wrapper
    out["strategy"] = facts.strategy_facts(model, optimizer)
    out["parameters"] = facts.parameter_facts(model, accelerator.process_index)
    out["model_class"] = facts.class_name(unwrapped)
    output = unwrapped.get_output_embeddings()
    out["tied_embeddings"] = output is not None and output.weight is unwrapped.get_input_embeddings().weight
    if optimizer is not None:
        out["optimizer_groups"] = facts.optimizer_facts(optimizer)
    meshes = [getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or () for p in model.parameters()]
    if any("tp" in names for names in meshes):
        out["tensor_parallel_parameters"] = facts.parameter_layout(model)
        out["tensor_parallel_replica_max_difference"] = facts.replica_max_difference(model, accelerator)
    elif any("dp_replicate" in names for names in meshes):  # HSDP: sharded per replica
        out["hsdp_parameters"] = facts.parameter_layout(model)
        out["hsdp_replica_max_difference"] = facts.replica_max_difference(model, accelerator, "dp_replicate")
    # a router's correction bias (DeepSeek-V3's buffer) as this rank routes with it
    out["correction_biases"] = {name: b.float().cpu().tolist() for name, b in unwrapped.named_buffers()
                                if name.endswith("correction_bias")}
    was_training = unwrapped.training
    unwrapped.eval()
    # the trained model's own logits, fp32, to compare with the export; run eagerly under --compile
    # (a shape of its own: compiling it cost ~6 s of recompiles after every compiled run)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        ids = torch.tensor([PROBE_INPUT_IDS], device=accelerator.device)
        out["probe_logits"] = unwrapped(input_ids=ids).logits[0].float().cpu().tolist()
    unwrapped.train(was_training)
    return out


# ---- fault injection ----
def _stop_dead(phase: str, step: int | None = None) -> None:
    where = phase if step is None else f"{phase} of step {step}"
    sys.stderr.write(f"fault injected: process {os.getpid()} stops dead at {where}\n")
    sys.stderr.flush()
    os._exit(FAULT_EXIT_CODE)


def _install_faults():
    phase, _, at = FAULT.partition("@")
    if phase in EXPORT_FAULT_PHASES:
        return _install_export_fault(phase)
    if phase not in FAULT_PHASES:
        raise RuntimeError(f"ACCELERATE_RECIPES_FAULT={FAULT!r}: unknown phase; choose one of "
                           f"{FAULT_PHASES + EXPORT_FAULT_PHASES}")

    def wanted(this_phase: str, step: int) -> bool:
        return this_phase == phase and (not at or int(at) == step) and _rank() == 0

    def step_of(path, pattern) -> int | None:
        match = re.fullmatch(pattern, Path(path).name)
        return int(match.group(1)) if match else None

    saving = {"step": None}
    from accelerate import Accelerator

    save_state = Accelerator.save_state

    def faulty_save_state(self, output_dir=None, *args, **kwargs):
        out = save_state(self, output_dir, *args, **kwargs)
        step = step_of(output_dir, r"\.step_(\d+)\.partial")
        saving["step"] = step
        if step is not None and wanted("after_shard", step):
            _stop_dead(phase, step)
        return out

    Accelerator.save_state = faulty_save_state

    replace, rename = os.replace, os.rename

    def faulty_replace(src, dst, *args, **kwargs):
        step = step_of(Path(dst).parent, r"\.step_(\d+)\.partial")
        if Path(dst).name == "checkpoint.json" and step is not None and wanted("during_metadata", step):
            size = os.path.getsize(src)
            os.truncate(src, size // 2)  # the write was cut half-way: the temporary file, never renamed
            _stop_dead(phase, step)
        return replace(src, dst, *args, **kwargs)

    def faulty_rename(src, dst, *args, **kwargs):
        step = step_of(src, r"\.step_(\d+)\.partial")
        if step is not None and wanted("before_rename", step):
            _stop_dead(phase, step)
        rotated = step_of(src, r"step_(\d+)")
        out = rename(src, dst, *args, **kwargs)
        if (rotated is not None and Path(dst).name.endswith(".deleting") and saving["step"] is not None
                and rotated != saving["step"] and wanted("during_rotation", saving["step"])):
            (Path(dst) / "checkpoint.json").unlink()  # half deleted
            _stop_dead(phase, saving["step"])
        return out

    os.replace, os.rename = faulty_replace, faulty_rename


def _install_export_fault(phase: str) -> None:
    """The export's moments, from outside it: its files are written by transformers (weights,
    config, tokenizer), then each is fsynced, the folder last; the swap follows (renameat2, or
    os.rename twice), then the old export is removed with shutil.rmtree."""
    if Path(sys.argv[0]).name == "accelerate":  # the launcher exports nothing (and would import transformers)
        return
    import shutil

    import safetensors.torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, modeling_utils

    synced = {"partial": False}  # set once the new folder itself is fsynced: the swap comes next

    def stop_at(this_phase: str) -> None:
        if this_phase == phase and _rank() == 0:
            _stop_dead(phase)

    save_file = modeling_utils.safe_save_file

    def faulty_save_file(tensors, filename, *args, **kwargs):
        if phase == "export_mid_weights" and _rank() == 0:
            data = safetensors.torch.save(tensors, *args, **kwargs)
            Path(filename).write_bytes(data[: len(data) // 2])  # the write cut half-way
            _stop_dead(phase)
        return save_file(tensors, filename, *args, **kwargs)

    modeling_utils.safe_save_file = faulty_save_file

    def stopping_after(method, this_phase):
        def wrapped(self, *args, **kwargs):
            out = method(self, *args, **kwargs)
            stop_at(this_phase)
            return out
        return wrapped

    PreTrainedModel.save_pretrained = stopping_after(PreTrainedModel.save_pretrained, "export_after_weights")
    PreTrainedTokenizerBase.save_pretrained = stopping_after(PreTrainedTokenizerBase.save_pretrained,
                                                             "export_after_tokenizer")
    fsync, rename, rmtree = os.fsync, os.rename, shutil.rmtree

    def faulty_fsync(fd):
        out = fsync(fd)
        if Path(os.readlink(f"/proc/self/fd/{fd}")).name == ".model.partial":
            synced["partial"] = True
            stop_at("export_before_swap")
        return out

    def faulty_rename(src, dst, *args, **kwargs):
        out = rename(src, dst, *args, **kwargs)
        if Path(dst).name == ".model.old":
            stop_at("export_set_aside")
        return out

    def faulty_rmtree(path, *args, **kwargs):
        if synced["partial"] and Path(path).name == ".model.partial":  # the old export, after the swap
            stop_at("export_after_swap")
            if phase == "export_removing_old" and _rank() == 0:
                (Path(path) / "model.safetensors").unlink()  # half removed: the weights gone, the rest not
                _stop_dead(phase)
        return rmtree(path, *args, **kwargs)

    os.fsync, os.rename, shutil.rmtree = faulty_fsync, faulty_rename, faulty_rmtree


def _cache_cpu_info(cache: Path) -> None:
    try:
        import cpuinfo  # py-cpuinfo, a DeepSpeed dependency; nothing to cache without it
    except ImportError:
        return
    measure = cpuinfo.get_cpu_info

    def cached_cpu_info():
        try:
            return json.loads(cache.read_text())
        except (OSError, ValueError):  # not written yet (or half written by a concurrent process)
            info = measure()
            partial = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
            partial.write_text(json.dumps(info))
            os.replace(partial, cache)
            return info

    cpuinfo.get_cpu_info = cached_cpu_info


def _slow_data_preparation(seconds: float) -> None:
    """Rank 0's first tokenising map sleeps first: a corpus that takes that long to prepare."""
    import datasets

    map_documents = datasets.Dataset.map

    def slow_map(self, *args, **kwargs):
        if not _seen.get("slept"):
            _seen["slept"] = True
            time.sleep(seconds)
        return map_documents(self, *args, **kwargs)

    datasets.Dataset.map = slow_map


def _disk_full_at(folder_name: str) -> None:
    """safetensors' writer, as accelerate (checkpoints) and transformers (the export) call it, for
    files inside a folder named `folder_name` (e.g. ".step_20.partial"): half the file is written,
    then ENOSPC, as a full disk does."""
    if Path(sys.argv[0]).name == "accelerate":  # the launcher writes nothing (and would import transformers)
        return
    import errno

    import safetensors.torch
    from accelerate.utils import other
    from transformers import modeling_utils

    save_file = other.safe_save_file

    def full_disk_save_file(tensors, filename, *args, **kwargs):
        if Path(filename).parent.name != folder_name:
            return save_file(tensors, filename, *args, **kwargs)
        data = safetensors.torch.save(tensors, *args, **kwargs)
        Path(filename).write_bytes(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device", str(filename))

    other.safe_save_file = modeling_utils.safe_save_file = full_disk_save_file


def _slow_eval(seconds: float) -> None:
    from torch import nn
    from transformers import GenerationMixin, PreTrainedModel

    def slow_call(self, *args, **kwargs):
        if isinstance(self, GenerationMixin):  # the LM itself, not its inner model
            if self.training:
                _seen["trained"] = True
            elif _seen.get("trained"):
                time.sleep(seconds)
        return nn.Module.__call__(self, *args, **kwargs)

    PreTrainedModel.__call__ = slow_call


if os.environ.get("ACCELERATE_RECIPES_DISK_FULL_AT"):
    _disk_full_at("." + os.environ["ACCELERATE_RECIPES_DISK_FULL_AT"] + ".partial")
if os.environ.get("ACCELERATE_RECIPES_SLOW_DATA") and _rank() == 0 and "LOCAL_RANK" in os.environ:
    _slow_data_preparation(float(os.environ["ACCELERATE_RECIPES_SLOW_DATA"]))
if os.environ.get("ACCELERATE_RECIPES_CPUINFO_CACHE"):
    _cache_cpu_info(Path(os.environ["ACCELERATE_RECIPES_CPUINFO_CACHE"]))
# Only in the processes `accelerate launch` starts (it sets ACCELERATE_MIXED_PRECISION for them): the
# launcher itself trains nothing, and importing transformers there would delay every launch by ~1 s.
if PROBE_DIR and "ACCELERATE_MIXED_PRECISION" in os.environ:
    _install_probes()
    if os.environ.get("ACCELERATE_RECIPES_PROBE_SYNCS") == "1":
        _count_host_syncs()
if os.environ.get("ACCELERATE_RECIPES_SLOW_EVAL") and "ACCELERATE_MIXED_PRECISION" in os.environ:
    _slow_eval(float(os.environ["ACCELERATE_RECIPES_SLOW_EVAL"]))
if FAULT:
    _install_faults()
