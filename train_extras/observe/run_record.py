"""The run's record, with one owner: train.py hands a `RunRecord` each step's facts, each eval and
each sample, and it writes them to every place a run is read from: `<output_dir>/run_summary.json`
(what a user keeps; written at the end, or at a preemption), `<output_dir>/metrics.jsonl` (the
history as it goes, crash-proof), the trackers of --report_to (through accelerate's log, after
train_extras/observe/tracking.py removed secrets from the config) and the progress bar, or plain
log lines when the output is a file, as under a scheduler.

run_summary.json: recipe, setup (the resolved launch and options), model (parameters, FLOPs per
token, compiled regions), peak_flops_per_device, data (blocks, the held-out bigram entropy),
losses (per step), eval, samples, throughput (per log interval, with memory per rank),
tracker_run, resumed_from (a resumed run), skipped_steps, then either preempted and tokens_seen, or
tokens_seen, export, peak_memory_per_rank, tokens_per_s_median and mfu_median. --eval_only writes
eval_summary.json instead, up to resumed_from plus its eval.

metrics.jsonl: one JSON object per line, appended and flushed at every log interval and every
eval, so a run killed without a tracker still leaves its loss curve (run_summary.json stays the
record written at the end). Flushed lines survive the process; they are fsynced with every
checkpoint, so after a machine's crash the file still reaches the checkpoint resumed from. A disk
that fills stops the lines with a warning, not the run (its next checkpoint save says more). Lines, by "kind":
  train     one per step: step, loss, lr, grad_norm (pre-clip; null for a skipped step), loss_scale (fp16),
            aux_loss (a mixture of experts: the router's load-balancing loss, apart from loss)
  interval  one per log interval: step (its last), steps, tokens/s (global, per device), step time,
            model TFLOP/s per device, mfu (null where the peak is unknown), eta_s, expert_load (MoE:
            per layer cv, max_share, min_share of the experts' routing slots), time (Unix seconds)
  eval      one per eval: step, loss, perplexity, tokens, time
A resumed run first keeps only the lines up to the step it resumes from (a crash can have logged
steps past its last checkpoint; they are trained again) and drops a line torn by a kill, then appends:
each step appears once, in order, across any number of restarts. Non-finite numbers are written
as null, so every line is strict JSON (`pandas.read_json(path, lines=True)` reads it).

Plain lines: under SLURM or Kubernetes stdout and stderr are files; tqdm's redraws (carriage
returns) fill them and never end a line. So the bar is drawn only when stderr (where tqdm draws)
is a terminal; otherwise the libraries' bars are off too and rank 0 prints one line per log interval:
  step 20/100 | loss 2.3456 | lr 1.00e-03 | grad norm 0.812 | 12,345 tok/s | MFU 12.3% | ETA 0:01:23
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from common.files import write_json
from train_extras import document_mask
from train_extras.observe import metrics, tracking

METRICS_FILE = "metrics.jsonl"


def _finite_or_none(value):
    return value if not isinstance(value, float) or math.isfinite(value) else None


def kept_lines(path: Path, resumed_step: int) -> list[str]:
    """The lines of an earlier part of this run up to `resumed_step`, ending at the first line that
    is not a whole JSON object (a kill during a write leaves one at the end)."""
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            row = json.loads(line) if line.endswith("\n") else None
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict):
            break
        if row.get("step", 0) <= resumed_step:
            kept.append(line)
    return kept


class MetricsFile:
    """Rank 0's appender for metrics.jsonl (does nothing elsewhere, or when `enabled` is False)."""

    def __init__(self, output_dir, resumed_step: int | None, enabled: bool):
        self.path = Path(output_dir) / METRICS_FILE
        self.file = None
        if not enabled:
            return
        # A fresh run starts the file anew (an output folder without checkpoints holds no run to go
        # on with); a resumed one keeps its past. Rewritten whole, then renamed: a kill here loses nothing.
        kept = kept_lines(self.path, resumed_step) if resumed_step is not None else []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(METRICS_FILE + ".partial")
        with open(partial, "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, self.path)
        self.file = open(self.path, "a")

    def write(self, rows: list[dict]) -> None:
        if self.file is None:
            return
        try:
            rows = tracking.redact_strings(rows)  # a mixture's source names are the user's
            self.file.write("".join(json.dumps({k: _finite_or_none(v) for k, v in row.items()}, allow_nan=False)
                                    + "\n" for row in rows))
            self.file.flush()  # to the OS: it survives this process; sync() makes it survive the machine
        except OSError as err:  # rank 0 alone writes: stopping here would leave the other ranks waiting
            print(f"warning: {self.path}: {err.strerror}; no more lines are written to it", flush=True)
            self.file = None

    def sync(self) -> None:
        """fsync, with each checkpoint: the lines up to it survive a crash of the machine too."""
        if self.file is not None:
            try:
                os.fsync(self.file.fileno())
            except OSError:
                pass

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def draw_bar() -> bool:
    """tqdm's bar on a terminal; plain lines when stderr is a file or a pipe (a scheduler's log)."""
    return sys.stderr.isatty()


def library_bars_off() -> None:
    """Without a terminal, datasets' map and transformers' save bars go too (their redraws as well)."""
    import datasets
    import huggingface_hub
    import transformers

    datasets.disable_progress_bars()
    huggingface_hub.utils.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def plain_line(step: int, max_steps: int, *, loss: float, lr: float, grad_norm: float, stats: dict) -> str:
    mfu = f" | MFU {stats['mfu']:.1%}" if stats["mfu"] is not None else ""
    norm = f"{grad_norm:.3f}" if math.isfinite(grad_norm) else "skipped"
    return (f"step {step}/{max_steps} | loss {loss:.4f} | lr {lr:.2e} | grad norm {norm} | "
            f"{stats['tokens_per_s']:,.0f} tok/s{mfu} | ETA {timedelta(seconds=round(stats['eta_s']))}")


def now() -> float:
    return round(time.time(), 3)


class RunRecord:
    """Everything a run records, written by this one object (main process for files and trackers;
    every rank calls every method, since some gather). Per-step numbers stay on the device and are
    fetched once per log interval (the one sync that also makes the interval's timing honest)."""

    def __init__(self, accelerator, cfg, setup: dict, *, peak: dict, data: dict, tokens_per_step: int,
                 flops_per_token: float, flops: dict | None = None):
        self.accelerator, self.cfg, self.main = accelerator, cfg, accelerator.is_main_process
        self.tokens_per_step, self.flops_per_token, self.peak_tflops = tokens_per_step, flops_per_token, peak["tflops"]
        # flops.flops(): beside MFU's figure, the one from the active weights and what is counted
        self.flops_counted = {} if flops is None else {"flops_per_token_active": flops["active"],
                                                       "flops_counted": flops["counted"]}
        self.summary = {"recipe": "train.py", "setup": setup, "model": None, "peak_flops_per_device": peak,
                        "data": data, "losses": [], "eval": [], "samples": [], "throughput": []}
        self.metrics = MetricsFile(cfg.output_dir, None, enabled=False)  # opened by open_metrics
        self.pending, self.step_times, self.interval_steps, self.bar = [], [], 0, None
        self.slots = None  # MoE: routing slots per (layer, expert) since the last interval

    # ---- before training ----
    def model(self, parameters: int, active_parameters: int, compiled_regions: dict, **facts) -> None:
        """active_parameters: per token (a mixture of experts: its top-k experts'; dense: all). facts:
        frozen (parameters the family builds frozen), ddp_unused_parameters (DDP: those the start-up
        probe found without a gradient; None elsewhere), router (MoE: train_extras/moe.py's route)."""
        self.summary["model"] = {"parameters": parameters, "active_parameters": active_parameters,
                                 "flops_per_token": self.flops_per_token, **self.flops_counted,
                                 "compiled_regions": compiled_regions, **facts}

    def documents(self, mode: str, why: str | None) -> None:
        """What keeps packed documents apart (train_extras/document_mask.py: asked of the model once it
        is built): the line under the setup block, and the record's setup (trackers get it too)."""
        self.summary["setup"]["documents"] = {"mode": mode, "why": why}
        if self.main:
            print(f"{'documents':<17}: {document_mask.describe(mode, why)}", flush=True)

    def start_trackers(self, resume_meta: dict | None) -> dict:
        """The tracker run's identity (kept in every checkpoint) and, unless --eval_only, the
        trackers: one tracker run across every restart of this output folder."""
        identity = tracking.run_identity(self.cfg, resume_meta)
        self.summary["tracker_run"] = identity
        if not self.cfg.eval_only:
            continued = resume_meta is not None and identity == resume_meta.get("tracker_run")
            tracking.start(self.accelerator, self.cfg, self.summary["setup"], identity,
                           resume_meta["step"] if continued else 0)
        return identity

    def resumed(self, path, meta: dict, changed: dict) -> None:
        """Where the run goes on from, and the options it changed (they hold from its next step)."""
        step = meta["step"]
        self.summary["resumed_from"] = {"path": str(path), "step": step, "world_size": meta["setup"]["world_size"],
                                        "changed": changed}
        if self.main:
            applied = "".join(f"; --{key} {old!r} -> {new!r}" for key, (old, new) in changed.items())
            print(f"resumed from {path} at step {step}"
                  + (f", with this run's settings from step {step + 1}{applied}"
                     if changed and not self.cfg.eval_only else ""), flush=True)

    def open_metrics(self, resumed_step: int | None) -> None:
        """metrics.jsonl: a fresh run starts it anew, a resumed one goes on with it from its step."""
        self.metrics = MetricsFile(self.cfg.output_dir, resumed_step, enabled=self.main)

    # ---- evals and samples ----
    def eval(self, step: int, result: dict) -> None:
        """A mixture's result also holds each source's ("sources": {name: result}): eval/<name>/loss."""
        self.summary["eval"].append({"step": step, **result})
        sources = result.get("sources", {})
        self.accelerator.log(tracking.redact_strings({
            "eval/loss": result["loss"], "eval/perplexity": result["perplexity"],
            **{f"eval/{name}/{key}": r[key] for name, r in sources.items() for key in ("loss", "perplexity")}}),
            step=step)
        self.metrics.write([{"kind": "eval", "step": step, **result, "time": now()}])
        if self.main:
            apart = "".join(f"  {name} {r['loss']:.4f}" for name, r in sources.items())
            tqdm.write(f"step {step}: eval loss {result['loss']:.4f}  perplexity {result['perplexity']:.2f}{apart}")

    def sample(self, step: int, prompt: str, text: str) -> None:
        self.summary["samples"].append({"step": step, "prompt": prompt, "text": text})
        if self.main:
            tqdm.write(f"step {step}: sample ({self.cfg.sample_length} tokens from {prompt!r}):\n{text}\n")

    def has_sample_at(self, step: int) -> bool:
        return bool(self.summary["samples"]) and self.summary["samples"][-1]["step"] == step

    def has_eval_at(self, step: int) -> bool:
        return bool(self.summary["eval"]) and self.summary["eval"][-1]["step"] == step

    # ---- training ----
    @contextlib.contextmanager
    def training(self, start_step: int):
        """The bar and the interval clock for the loop; bar and metrics.jsonl are closed however it
        ends (an error line printed after this starts on a line of its own)."""
        self.plain = self.main and not draw_bar()
        self.bar = tqdm(total=self.cfg.max_steps, initial=start_step, desc="train", disable=not self.main or self.plain)
        self.start = time.perf_counter()
        try:
            yield self
        finally:
            self.bar.close()
            self.metrics.close()

    def step(self, step: int, lr: float, loss: torch.Tensor, grad_norm, loss_scale: float | None,
             aux_loss: torch.Tensor | None = None) -> None:
        """One optimizer step's facts. grad_norm: clip_grad_norm_'s result (a DTensor under FSDP2, a
        float under DeepSpeed, None for a skipped step), kept on the device like the loss and the
        router's loss (mixture-of-experts models only)."""
        norm = metrics.as_tensor(grad_norm, loss.device)
        self.pending.append((step, lr, loss, norm, loss_scale, aux_loss))

    def expert_slots(self, slots: torch.Tensor) -> None:
        """A micro-batch's routing slots per (layer, expert), on the device, added up to the interval."""
        self.slots = slots if self.slots is None else self.slots + slots

    def _drain(self) -> list[dict]:
        """Fetch the steps given since the last call (one host sync) into run_summary.json and the
        trackers; returns their metrics.jsonl lines."""
        if not self.pending:
            return []
        nan = torch.full((), float("nan"), device=self.pending[0][2].device)
        losses, norms, auxes = torch.stack([torch.stack([loss, norm, nan if aux is None else aux.float()])
                                            for _, _, loss, norm, _, aux in self.pending]).T.tolist()
        lines = []
        for (s, lr, _, _, loss_scale, aux), loss, norm, aux_value in zip(self.pending, losses, norms, auxes):
            row = {"step": s, "loss": loss, "lr": lr, "grad_norm": norm}
            if loss_scale is not None:
                row["loss_scale"] = loss_scale
            if aux is not None:
                row["aux_loss"] = aux_value
            self.summary["losses"].append(row)
            lines.append({"kind": "train", **row})
            self.accelerator.log({f"train/{k}": v for k, v in row.items() if k != "step"}, step=s)
        self.interval_steps += len(self.pending)
        self.last = {"loss": losses[-1], "lr": self.pending[-1][1], "grad_norm": norms[-1]}
        self.pending = []
        return lines

    def steps_to_file(self) -> None:
        """The steps so far into metrics.jsonl and the trackers: before an eval, so that its step
        comes after theirs everywhere (wandb drops a step logged after a later one), and before a
        fatal error."""
        self.metrics.write(self._drain())

    def interval(self, step: int) -> None:
        """A log interval ends at `step`: throughput, MFU, memory per rank (a small gather), ETA."""
        lines = self._drain()
        elapsed = time.perf_counter() - self.start
        self.start = time.perf_counter()  # what logging costs below counts in the next interval
        steps, self.interval_steps = self.interval_steps, 0
        self.step_times.append(elapsed / steps)
        stats = metrics.interval_stats(
            steps=steps, seconds=elapsed, tokens_per_step=self.tokens_per_step,
            world_size=self.accelerator.num_processes, flops_per_token=self.flops_per_token,
            peak_tflops_per_device=self.peak_tflops, steps_left=self.cfg.max_steps - step, step_times=self.step_times)
        if self.peak_tflops and stats["mfu"] is None:
            self._peak_exceeded(step, stats["model_tflops_per_device"])
        memory = metrics.peak_memory(self.accelerator)
        experts = self._expert_load()
        self.summary["throughput"].append({"step": step, **stats, "memory_per_rank": memory, **experts})
        self.metrics.write(lines + [{"kind": "interval", "step": step, "steps": steps, **stats, **experts,
                                     "time": now()}])
        if self.plain:
            print(plain_line(step, self.cfg.max_steps, stats=stats, **self.last), flush=True)
        self.accelerator.log({f"perf/{k}": v for k, v in stats.items() if v is not None}
                             | {f"memory/rank{m['rank']}_{k}": v for m in memory for k, v in m.items() if k != "rank"}
                             | {f"experts/layer{i}_{k}": v for k, values in experts.get("expert_load", {}).items()
                                for i, v in enumerate(values)},
                             step=step)
        self.bar.set_postfix(loss=f"{self.last['loss']:.4f}", lr=f"{self.last['lr']:.2e}",
                             tok_s=f"{stats['tokens_per_s']:,.0f}",
                             **({"mfu": f"{stats['mfu']:.1%}"} if stats["mfu"] is not None else {}))
        self.bar.update(steps)

    def _peak_exceeded(self, step: int, achieved: float) -> None:
        """A device did more than its peak: the peak is wrong, so no MFU of this run is (the summary's
        earlier ones are dropped too; the lines already in metrics.jsonl and the trackers stay)."""
        peak = self.summary["peak_flops_per_device"]
        peak["exceeded"] = {"step": step, "model_tflops_per_device": achieved}
        self.peak_tflops = None
        for interval in self.summary["throughput"]:
            interval["mfu"] = None
        if self.main:
            tqdm.write(f"warning: step {step}: {achieved:.3g} model TFLOP/s per device, above the peak MFU is "
                       f"measured against ({peak['tflops']:.3g}, {peak['source']}): that peak is wrong (a CPU "
                       "busier when it was measured than now?); MFU is unknown for this run", file=sys.stderr)

    def _expert_load(self) -> dict:
        """{"expert_load": per layer cv, max_share, min_share} over every rank's routing since the
        last interval (a small all-reduce), or {} for a dense model."""
        if self.slots is None:
            return {}
        from train_extras.moe import load_stats

        slots, self.slots = self.accelerator.reduce(self.slots, "sum"), None
        return {"expert_load": load_stats(slots)}

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (eval, checkpoint) is not training time: kept out of the interval's tokens/s."""
        t0 = time.perf_counter()
        yield
        self.start += time.perf_counter() - t0

    def sync(self) -> None:
        """With each checkpoint: metrics.jsonl up to it survives a crash of the machine too."""
        self.metrics.sync()

    # ---- the end ----
    def _write(self, name: str) -> None:
        if self.main:  # no secret at rest: the samples' prompts, the paths, the names (observe/tracking.py)
            write_json(f"{self.cfg.output_dir}/{name}", tracking.redact_strings(self.summary))

    def skipped_steps(self, **counts: int) -> None:
        """Steps the loop skipped, by cause (a NaN/inf loss, an fp16 overflow)."""
        self.summary["skipped_steps"] = counts

    def preempted(self, preempted: dict) -> None:
        """The losses so far and where to go on from (no export of an unfinished model)."""
        self.summary.update(preempted=preempted, tokens_seen=preempted["step"] * self.tokens_per_step)
        self._write("run_summary.json")

    def finished(self, export, start_step: int) -> None:
        """run_summary.json of a finished run and its last line. Every rank: gathers peak memory."""
        self.summary["tokens_seen"] = self.cfg.max_steps * self.tokens_per_step
        if export is not None:
            self.summary["export"] = str(export)
        self.summary["peak_memory_per_rank"] = metrics.peak_memory(self.accelerator)
        rates = [t["tokens_per_s"] for t in self.summary["throughput"]]
        mfus = [t["mfu"] for t in self.summary["throughput"] if t["mfu"] is not None]
        self.summary["tokens_per_s_median"] = float(np.median(rates)) if rates else None
        self.summary["mfu_median"] = float(np.median(mfus)) if mfus else None
        self._write("run_summary.json")
        if self.main:
            print(self.final_line(start_step), flush=True)

    def final_line(self, start_step: int) -> str:
        cfg, summary = self.cfg, self.summary
        if not summary["throughput"]:  # resumed at max_steps: nothing trained, only exported
            return f"done: no steps to run (resumed at step {start_step}) -> {cfg.output_dir}"
        if summary["eval"]:
            quality = (f"final eval loss {summary['eval'][-1]['loss']:.4f} (bigram entropy of held-out data "
                       f"{summary['data']['eval_bigram_entropy']:.4f})")
        else:
            quality = f"last train loss {summary['losses'][-1]['loss']:.4f} (no eval: --eval_every 0)"
        mfu = f", MFU {summary['mfu_median']:.1%}" if summary["mfu_median"] is not None else ""
        return (f"done: {cfg.max_steps} steps, {quality}, median {summary['tokens_per_s_median']:,.0f} tokens/s{mfu}"
                f" -> {cfg.output_dir}")

    def evaluated_only(self, step: int, result: dict) -> None:
        """--eval_only: the held-out loss into eval_summary.json (a training run's own record there
        is left alone) and one line."""
        self.summary["eval"].append({"step": step, **result})
        self._write("eval_summary.json")
        if self.main:
            source = self.summary.get("resumed_from", {}).get("path") or self.cfg.model_name_or_path
            print(f"eval only: {source}: held-out loss {result['loss']:.4f}  perplexity {result['perplexity']:.2f} "
                  f"({result['tokens']:,} tokens; bigram entropy {self.summary['data']['eval_bigram_entropy']:.4f})",
                  flush=True)
