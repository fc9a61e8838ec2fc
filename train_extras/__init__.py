"""What only recipes/train.py (and the TP / pipeline recipes) need beside the core in common/:
resume and atomic checkpoints, preemption and lost ranks, trackers, throughput/MFU/memory, FLOPs,
sampling, FSDP2/DeepSpeed settings for any model, tensor/2D/pipeline parallelism, train.py's options."""
