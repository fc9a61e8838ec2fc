"""Observing a run: the one owner of its record (run_record.py: run_summary.json, metrics.jsonl,
the trackers and the bar or plain log lines), what it measures (metrics.py: throughput, MFU,
memory, the bigram bar), FLOPs per token (flops.py), trackers with secrets removed (tracking.py)
and a sample of generated text (sampling.py)."""
