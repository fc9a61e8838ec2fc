"""Shared pieces every recipe uses unchanged: config, model, data, schedule, checkpoint, metrics."""
