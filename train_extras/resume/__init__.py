"""Resuming a run: atomic, verified checkpoints and the rules for resuming one (checkpoint.py),
one live run per output folder, only its own files replaced and a finished run kept
(output_dir.py), and preemption: save, requeue marker, exit 75, and stopping when a rank is lost
(preemption.py)."""
