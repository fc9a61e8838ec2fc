"""Parallelism beyond what the launch config says: FSDP2 settings (fsdp_settings.py) and DeepSpeed
settings (deepspeed_settings.py), one module each; the threads of a lone CPU process
(cpu_threads.py); tensor parallel and 2D FSDP2 x TP (tensor_parallel.py); pipeline stages
(pipeline.py)."""
