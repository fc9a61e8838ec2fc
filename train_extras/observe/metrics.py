"""What train.py measures beyond the loss: throughput and MFU, memory, and the bigram bar the
held-out loss should clear.

Per log interval the recipe records tokens/s (global and per device), step time, MFU, memory per
rank and an ETA; per step loss, lr, pre-clip gradient norm and the fp16 loss scale. MFU = the model
FLOP/s a device achieves (flops_per_token x its tokens/s) over its peak: the datasheet's dense
tensor-core figure for known GPUs, and on a CPU (which has no such table) a square matmul (512 or
more) in the run's dtype measured once before training with the process's own threads, best of
several bursts. MFU above 100% is never reported: the peak is then known to be wrong (a CPU busier
when measured than when training), and the run says so and reports MFU as unknown from there on.

(The held-out loss itself is common/model.py's evaluate, shared by every recipe.)
"""

from __future__ import annotations

import re
import resource
import time

import numpy as np
import torch
from accelerate.utils import gather_object


def as_tensor(grad_norm, device) -> torch.Tensor:
    """A clip_grad_norm_ result as a plain tensor on `device`, without a host sync: FSDP2 returns a
    DTensor, DeepSpeed a float (already on the host), a skipped step None (NaN)."""
    if grad_norm is None:
        return torch.full((), float("nan"), device=device)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    if isinstance(grad_norm, torch.Tensor):
        return grad_norm.detach().float().to(device)
    return torch.tensor(float(grad_norm), device=device)


def compiled_regions(model) -> dict:
    """{class name: count} of the modules torch.compile wraps (--compile: accelerate's regional
    compilation wraps each repeated block, in place under FSDP2 and DeepSpeed)."""
    from torch._dynamo.eval_frame import OptimizedModule

    names = [type(m._orig_mod).__name__ if isinstance(m, OptimizedModule) else type(m).__name__
             for m in model.modules()
             if isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None]
    return {name: names.count(name) for name in sorted(set(names))}


def count_parameters(model) -> int:
    """All parameter elements, also when ZeRO-3 has partitioned them away (ds_numel)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


# Dense (no sparsity) peak tensor-core TFLOP/s per GPU, by exact part, from the vendors' datasheets.
# NVIDIA's datasheets quote bf16/fp16/tf32 "with sparsity" (2x); the dense figure is half. fp32 runs
# use the last column: the tf32 rate on NVIDIA parts, since common/model.py turns TF32 matmuls on.
# MFU = achieved model FLOPs / this peak. Each entry: (pattern for torch.cuda.get_device_name,
# upper-cased, "NVIDIA " removed; part; bf16, fp16, fp32 runs).
GPU_PEAKS = [
    # NVIDIA A100 datasheet (A100 40GB/80GB, PCIe and SXM4 alike): BF16/FP16 312, TF32 156.
    # torch: "NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe".
    (r"A100([- ]SXM4?)?[- ](40|80)GB( PCIE)?|A100-PCIE-(40|80)GB", "A100", 312.0, 312.0, 156.0),
    # NVIDIA H100 datasheet, SXM5: BF16/FP16 1,979 and TF32 989 with sparsity. torch: "NVIDIA H100 80GB HBM3".
    (r"H100 80GB HBM3|H100 SXM5?( 80GB)?", "H100 SXM", 989.5, 989.5, 494.5),
    # Same datasheet, PCIe: 1,513 / 756 with sparsity. torch: "NVIDIA H100 PCIe".
    (r"H100 PCIE", "H100 PCIe", 756.5, 756.5, 378.0),
    # Same datasheet, NVL (per GPU): 1,671 / 835 with sparsity. torch: "NVIDIA H100 NVL".
    (r"H100 NVL", "H100 NVL", 835.5, 835.5, 417.5),
    # NVIDIA H200 datasheet, SXM: as H100 SXM (same compute, more and faster memory). torch: "NVIDIA H200".
    (r"H200", "H200 SXM", 989.5, 989.5, 494.5),
    # Same datasheet, H200 NVL: 1,671 / 835 with sparsity. torch: "NVIDIA H200 NVL".
    (r"H200 NVL", "H200 NVL", 835.5, 835.5, 417.5),
    # NVIDIA DGX/HGX B200 specifications, 8 GPUs: FP16/BF16 36 PFLOPS and TF32 18 PFLOPS with sparsity.
    (r"B200", "B200", 2250.0, 2250.0, 1125.0),
    # NVIDIA L40S datasheet: BF16/FP16 362.05 dense (733 with sparsity), TF32 183 (366). torch: "NVIDIA L40S".
    (r"L40S", "L40S", 362.05, 362.05, 183.0),
    # NVIDIA L4 datasheet: BF16/FP16 242 and TF32 120 with sparsity. torch: "NVIDIA L4".
    (r"L4", "L4", 121.0, 121.0, 60.0),
    # NVIDIA A10 datasheet: BF16/FP16 250 and TF32 125 with sparsity. (AWS's A10G has no public
    # datasheet: unknown, so no MFU rather than a guessed one.)
    (r"A10", "A10", 125.0, 125.0, 62.5),
    # AMD Instinct MI300X data sheet: peak BF16/FP16 1,307.4 dense, FP32 matrix 163.4. fp32 runs get
    # the FP32 figure, not TF32's 653.7: ROCm's torch does not run fp32 matmuls as TF32 by default.
    # ROCm's torch names it "AMD Instinct MI300X" (a virtual function: "... MI300X VF").
    (r"AMD INSTINCT MI300X( VF)?", "MI300X", 1307.4, 1307.4, 163.4),
]


def gpu_peak(device_name: str, precision: str) -> tuple[float | None, str]:
    """(dense peak TFLOP/s, the part it is for) for a GPU name as torch reports it, matched whole
    (an H100 PCIe is not an H100 SXM); (None, why) for a part not in GPU_PEAKS."""
    name = re.sub(r"^NVIDIA\s+", "", device_name.strip().upper())
    column = {"bf16": 0, "fp16": 1}.get(precision, 2)
    for pattern, part, *peaks in GPU_PEAKS:
        if re.fullmatch(pattern, name):
            return peaks[column], part
    return None, f"no datasheet peak for {device_name!r} in train_extras/observe/metrics.py GPU_PEAKS"


def peak_tflops(device_name: str, precision: str) -> float | None:
    """Datasheet peak for a GPU name as torch reports it (e.g. 'NVIDIA H200'), or None if unknown."""
    return gpu_peak(device_name, precision)[0]


MIN_MATMUL = 512  # smaller, a matmul's rate is its overheads', not the device's: no honest peak


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, size: int = 1024, seconds: float = 0.1,
                          bursts: int = 5) -> tuple[float, int]:
    """Best rate of a size x size matmul in `dtype` (TFLOP/s) and the size used: best of `bursts`
    timed bursts of about `seconds` each after a warm-up of twice that, the practical ceiling of
    this device with this process's threads. (Noise only slows a burst down, so the best one is the
    estimate; a single short burst at start-up was measured up to 20% low.) Where one matmul alone
    takes longer than a burst, the size halves, down to MIN_MATMUL, chosen from the best of three
    timings of a 256 matmul: fp16 on a CPU without fp16 units ran a 1024 one in 2.1 s (and the
    measurement took 15 s of every start-up; at 512, 0.9 s). It never goes below MIN_MATMUL: on a
    loaded CPU one slow timing once shrank it to 128, whose rate is a fraction of the real ceiling,
    and the run reported MFU 242.9%."""
    rng = torch.Generator(device=device).manual_seed(0)  # never the global RNG: it seeds the model's init

    def burst(a, b, reps: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    probe = torch.randn(256, 256, device=device, dtype=dtype, generator=rng)
    burst(probe, probe, 1)  # the first call pays for kernel choice (on a GPU, cuBLAS set-up): not timed
    probe_seconds = min(burst(probe, probe, 1) for _ in range(3))
    while size > MIN_MATMUL and probe_seconds * (size / 256) ** 3 > seconds:
        size //= 2
    a = torch.randn(size, size, device=device, dtype=dtype, generator=rng)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=rng)
    warm_until = time.perf_counter() + 2 * seconds  # warm-up: thread pool, kernel choice, clock
    while time.perf_counter() < warm_until:
        burst(a, b, 1)
    reps = max(1, int(seconds / max(burst(a, b, 1), 1e-6)))
    return max(2 * size**3 * reps / burst(a, b, reps) for _ in range(bursts)) / 1e12, size


def peak_flops(accelerator) -> dict:
    """Per-device peak for MFU: {'tflops': float | None, 'source': str}."""
    precision = accelerator.mixed_precision
    if accelerator.device.type == "cuda":
        name = torch.cuda.get_device_name(accelerator.device)
        tflops, part = gpu_peak(name, precision)
        return {"tflops": tflops, "source": f"{part} datasheet, {precision} dense" if tflops else part}
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    threads = torch.get_num_threads()
    tflops, size = measure_matmul_tflops(accelerator.device, dtype)
    return {"tflops": tflops, "source": f"measured {str(dtype)[6:]} {size}x{size} matmul, {threads} threads"}


def interval_stats(*, steps: int, seconds: float, tokens_per_step: int, world_size: int, flops_per_token: float,
                   peak_tflops_per_device: float | None, steps_left: int, step_times: list[float]) -> dict:
    """Throughput of one log interval; `step_times` holds the mean step time of every interval so
    far (this one included) and gives the ETA by its median (robust to an eval or a save). MFU is
    None where the peak is unknown, and where the device did more than its peak (no device does:
    the peak is wrong, say a CPU measured while other work shared it)."""
    tokens_per_s = steps * tokens_per_step / seconds
    per_device = tokens_per_s / world_size
    mfu = per_device * flops_per_token / (peak_tflops_per_device * 1e12) if peak_tflops_per_device else None
    if mfu is not None and mfu > 1:  # above its peak: the peak is wrong (RunRecord says so, once)
        mfu = None
    median_step = sorted(step_times)[len(step_times) // 2]
    return {
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": per_device,
        "step_time_s": seconds / steps,
        "model_tflops_per_device": per_device * flops_per_token / 1e12,
        "mfu": mfu,
        "eta_s": steps_left * median_step,
    }


def peak_memory(accelerator) -> list[dict]:
    """Every rank's peak memory so far (CUDA allocated/reserved, the process's peak RSS) and its
    CUDA allocation now. A collective: call on all ranks."""
    mine = {"rank": accelerator.process_index,
            "cpu_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
    if accelerator.device.type == "cuda":
        mine["cuda_allocated_bytes"] = torch.cuda.memory_allocated(accelerator.device)
        mine["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(accelerator.device)
        mine["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved(accelerator.device)
    return gather_object([mine]) if accelerator.num_processes > 1 else [mine]


def token_stream(dataset) -> np.ndarray:
    """The tokens a held-out dataset holds: packed blocks, rows of whole examples (their stream), or
    padded documents (common/data.py's, or train_extras/data/packing.py's on them)."""
    if hasattr(dataset, "piece_lengths"):  # packing.FittedRows: every example, whole
        return np.asarray(dataset.stream)
    if hasattr(dataset, "blocks"):
        return dataset.blocks.reshape(-1)
    return np.concatenate([np.asarray(ids[: dataset.seq_len + 1]) for ids in dataset.docs["input_ids"]])


def bigram_entropy(stream: np.ndarray) -> float:
    """Conditional entropy H(x_t | x_{t-1}) of a token stream, in nats, from its own counts.

    This is the loss of the best possible bigram model *fitted on this very data* (a lower bound
    for any bigram model evaluated on it): a held-out loss below it shows the model uses more
    context than the previous token.
    """
    stream = np.asarray(stream, dtype=np.int64)
    vocab = int(stream.max()) + 1
    pairs = stream[:-1] * vocab + stream[1:]
    _, pair_counts = np.unique(pairs, return_counts=True)
    _, prev_counts = np.unique(stream[:-1], return_counts=True)

    def entropy(counts):
        p = counts / counts.sum()
        return float(-(p * np.log(p)).sum())

    return entropy(pair_counts) - entropy(prev_counts)
