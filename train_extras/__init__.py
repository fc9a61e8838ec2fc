"""What only recipes/train.py (and the TP / pipeline recipes) need beside the core in common/, by
capability:

    options.py       train.py's options: the core groups plus its own, checked in a written order
    document_mask.py what keeps packed documents apart in the model (asked of it at start-up)
    data/            what train.py reads, one file per step of the data flow: sources, formats
                     (messages, ShareGPT, OpenAI parts), render (chat template, trained mask),
                     packing (document masks), assemble (one source or a mixture), at_scale
    resume/          checkpoints (save, verify, resume rules), the output folder, preemption
    observe/         the run's record (run_summary.json, metrics.jsonl, trackers, log lines),
                     throughput/MFU/memory, FLOPs, secrets kept from trackers, a sample of text
    parallel/        FSDP2 and DeepSpeed settings (one module each), CPU threads, TP/2D, pipeline
"""
