"""Memory planner: will my model fit, and with which config?

    python -m tools.plan --preset 8b --gpus 8 --gpu_memory_gb 80 --seq_len 4096 --micro_batch_size 1
    python -m tools.plan --model_name_or_path path/to/hf_folder --gpus 4 --gpu_memory_gb 40
    python -m tools.plan --params 7e9 --gpus 8 --textbook
    python -m tools.plan --preset 8b --gpus 1 --gpu_memory_gb 16 --host_memory_gb 64

For every rung of LADDER (cheapest first; plus HSDP when --gpus spans several whole machines of
--gpus_per_node) it prints the memory per GPU, split into parameters, gradients, optimizer states
(master copies included), framework buffers, activations and logits, at rest and at peak, and the
CPU RAM per process; marks what fits ("tight" when the peak is above 90% of the usable memory);
names the cheapest config in accelerate_configs/ that fits with headroom (the cheapest tight one,
with a warning, when only tight ones fit) with its launch line; and when nothing fits, checks
concretely what would (more GPUs, more CPU RAM, activation checkpointing, a smaller micro-batch,
offload) and names those that work. Units: 1 GB = 1e9 bytes.
The presets use the byte tokenizer's 259-token vocabulary (the '8b' preset is 6.98B parameters; a
real Llama-3-8B config, 128k vocabulary, is 8.03B with ~500x larger logits): for a real model pass
--model_name_or_path to a local folder with its config.json. The output says so for presets.

Where the numbers come from
- Model states (`model_state_bytes`): one formula per framework, as configured in this repo, read
  from the installed sources (deepspeed 0.19.8, torch 2.13, accelerate 1.15). Every term is a named
  entry with the file/line that justifies it, so a measurement that disagrees points at one term.
  `--textbook` swaps in the ZeRO paper's numbers (`textbook_bytes`).
- Activations and logits (`activation_bytes`): counted, not taken from GPT constants. One
  transformers LlamaDecoderLayer of the model's dimensions (sdpa, causal, no mask) runs under fake
  tensors (torch's FakeTensorMode: every op's shapes, dtypes and storages, no arithmetic, so an 8B
  or 405B block answers in a second; the same probe on real CPU tensors gives the same bytes,
  tests/test_plan.py) at a probe size (batch 1, min(seq_len, 256) tokens); `saved_tensors_hooks` sum the bytes of what
  autograd saves (deduplicated by storage, parameters excluded). The final norm + LM head + fp32
  cross-entropy of `common.model.causal_lm_loss` are probed the same way ("logits"). Results are
  scaled linearly to micro_batch_size x seq_len tokens. ASSUMPTION: attention keeps O(seq) memory
  per layer (SDPA flash / memory-efficient kernels save the output and a log-sum-exp, never the
  T x T scores). True for the GPU kernels and for the CPU flash kernel the probe runs; a math
  fallback (e.g. an explicit attention mask) would add O(seq^2) that this does not show.
  With activation checkpointing the probe wraps the layer in the same non-reentrant checkpoint
  that common/model.py enables and measures what it keeps (full: the block's input; selective:
  also the matmul and attention outputs, common/model._keeps, seen as the storages alive
  once forward ends); during a block's backward the rest is recomputed (full: all of it).
  --loss_chunk_size: the head is train_extras/chunked_loss.py's own (hidden states kept, one chunk's
  logits alive at a time).
  Peak moments of backward: the head's (every block's activations + the logits + the logits'
  gradient), the first block's (the head's tensors freed; every block's activations, its
  recompute and backward transient) and the last block's (one block's activations left, almost
  every gradient made); the largest counts. Each moment holds the gradients backward has made by
  then (.grad on one GPU and DDP, FSDP2's shards: a share of the parameters, all of them with
  accumulation, whose earlier micro-batches made them; DeepSpeed's are counted whole).
  The tensors alive during one block's / the head's backward are measured too (live storages,
  tracked with a dispatch mode, the weights' gradients accumulated into .grad as in training) on
  both sides of the moment its first weight gradient appears, and added as a transient: before
  it, with the gradients of the units done; after it, with its own too.
  Columns: "activ" = the blocks' saved tensors + one block's backward transient (+ the recomputed
  block); "logits" = the head's saved tensors + the head's backward transient (the logits' fp32
  gradient, tokens x vocab x 4 bytes and its cast: for a large vocabulary it rivals the blocks).
- Peak: the largest of three candidates.
  forward/backward = model states at the largest moment of backward above (the gradients made by
    then) + parameters in flight (FSDP2 all-gathers, ZeRO-3 fetches, autocast's bf16 weight copies)
    + backward buffers + activations + logits. On one CPU process it is within 1% of every storage
    measured alive at once (tests/test_plan.py, every --gradient_checkpointing x --loss_chunk_size)
    and 3% above it with full checkpointing on a small vocabulary.
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
  NOT AN UPPER BOUND. Measured on CPU (benchmarks/results/memory-2026-12-06: 113.7M parameters,
  2 ranks, bf16, micro-batch 2 x 256) the peak was ABOVE the plan: DDP +1%, FSDP2 +4-5%, ZeRO-1
  +4%, ZeRO-2 +6%, ZeRO-3 +20%, ZeRO-3 offload +22% (FSDP2 + offload: 14% below). The model states
  at rest agree within 1-4%, so the ZeRO-3 gap is in transients this does not model; unverified
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

- --lora_r R (train.py's LoRA): the adapters its default targets get (train_extras/lora.py), injected
  by peft into the meta model and counted, are stored beside the base and are the only parameters
  with gradients, fp32 master copies and optimizer states, under every rung (the frameworks keep
  those for parameters that require grad); the base's own parameter storage is unchanged.
  Activations are probed as for full training (a frozen layer's input is still kept for the
  adapter beside it).

Assumptions (each is one named term or one line of code):
- Parameters in flight: FSDP2 full shard holds two blocks (current + prefetched) and the tail unit
  [final norm, lm_head] that accelerate never reshards after forward (with tied embeddings the tail
  is [final norm, embedding = lm_head]: fsdp_utils.py:863-879); without reshard, every unit.
  ZeRO-3 holds the largest module plus stage3_prefetch_bucket_size elements (max_live_parameters
  caps it). DDP/single under autocast keep a bf16 copy of every weight until its backward (measured).
- DeepSpeed bucket sizes come from the JSONs in accelerate_configs/ ("auto" = accelerate's fill).
- --gradient_accumulation_steps: FSDP2 under train.py reduce-scatters every micro-batch (its
  --fsdp_sync_each_batch, default true), so accumulation adds nothing there; with
  --fsdp_sync_each_batch false every GPU keeps the whole unsharded fp32 gradient between
  micro-batches (+4 bytes per trained parameter, counted; measured on 2 CPU ranks: exactly that).
  ZeRO-1 keeps full-size gradients between micro-batches (+2 bytes/parameter in bf16): not modelled.
- fp16 is probed as bf16 (same sizes); a non-Llama config is probed as a Llama block of its dims.

Layout: ladder.py (rungs, model shape), states.py (model-state formulas), activations.py (the
CPU probes), advice.py (rows, fits, what would fit), cli.py (options and the table); this file
re-exports what callers use (tests, benchmarks/memory.py).

Exit codes: 0 when the plan is printed, whether or not something fits (a line "fits: ..." followed
by the launch line, or a last line "nothing fits: ..."); 2 on bad input (including a number that is
inf or nan), with one line "error: ..." on stderr.
"""

from tools.plan.activations import SavedBytes, activation_bytes, live_tracker, probe_block, probe_head, regime_of
from tools.plan.advice import TIGHT, Request, advice, cheapest, evaluate, launch_line, more_gpus, smallest_gpu_count
from tools.plan.cli import main, render
from tools.plan.ladder import (CONFIG_DIR, GB, HSDP, LADDER, RUNGS, SINGLE, ModelShape, PlanError, Rung, get_rung,
                                ladder, load_config, model_shape)
from tools.plan.states import (CATEGORIES, INIT_MOMENTS, TRANSIENTS, WHEN, model_state_bytes, textbook_bytes,
                                zero3_init, zero_settings)

__all__ = ["CATEGORIES", "CONFIG_DIR", "GB", "HSDP", "INIT_MOMENTS", "LADDER", "RUNGS", "SINGLE", "TIGHT", "TRANSIENTS",
           "WHEN",
           "ModelShape", "PlanError", "Request", "Rung", "SavedBytes", "activation_bytes", "advice", "cheapest",
           "evaluate", "get_rung", "ladder", "launch_line", "live_tracker", "load_config", "main", "model_shape",
           "model_state_bytes", "more_gpus", "probe_block", "probe_head", "regime_of", "render", "smallest_gpu_count",
           "textbook_bytes", "zero3_init", "zero_settings"]
