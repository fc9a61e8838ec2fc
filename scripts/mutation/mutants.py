"""The deliberate bugs (mutants) that `python -m scripts.mutation` plants one at a time in a scratch copy
of the checkout, and the tests that must catch each one (docs/testing.md#the-mutation-check).

Each entry:
- id: short and stable (used by --only and in the results);
- file: the product file (recipes/, common/, train_extras/, tools/plan/) relative to the repository root;
- old: a snippet that occurs exactly once in that file (tests/test_mutation_tool.py checks this against
  today's code, so the list cannot rot silently: when the code moves, fix the snippet);
- new: what replaces it (the bug);
- what: the bug in one line;
- tests: the smallest set of existing pytest node ids (files or file::test ids) that must catch it,
  in-process ones or ones sharing one launch where that is enough;
- timeout: seconds (optional; the command's --timeout otherwise);
- note: optional, e.g. why a test that looks relevant cannot see the bug.

Most mutants sit at the seams between features (accumulation x normalisation, clipping x fp16,
schedule x resume, data order x epochs x world size, checkpoints x crashes, eval x ranks...). The
`seam-*` mutants are the bugs of issue 41's audit that every single-feature test passed, and more at
the same seams: tests/test_seams.py, tests/test_seams_moe.py and test_moe.py's every-rank test catch them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    old: str
    new: str
    what: str
    tests: tuple[str, ...]
    timeout: int | None = None
    note: str = field(default="", compare=False)


ACC = "tests/test_accumulation.py::"
DOCS = "tests/test_documents.py::"
PLAN = "tests/test_plan.py::"
SETTINGS = "tests/test_strategy_settings.py::"

MUTANTS: list[Mutant] = [
    # ---- accumulation, normalisation, clipping ----
    Mutant(
        id="accum-scale-train",
        file="recipes/train.py",
        old="scale = accumulation * accelerator.num_processes / step_tokens",
        new="scale = accelerator.num_processes / step_tokens",
        what="train.py forgets to undo accelerate's division by the accumulation steps (gradient 1/accum too small)",
        tests=("tests/test_hsdp.py::test_losses_match_one_process",),
        note="HSDP accumulates 2 micro-batches and compares grad norms with train_run (rel 1e-4); AdamW hides "
             "a constant factor in the losses",
    ),
    Mutant(
        id="accum-rank-local-tokens",
        file="recipes/accumulate_and_clip.py",
        old='step_tokens = accelerator.reduce(sum((b["labels"] != -100).sum() for b in micro_batches), "sum")',
        new='step_tokens = sum((b["labels"] != -100).sum() for b in micro_batches)',
        what="each rank normalises by its own target tokens instead of the step's total over all ranks",
        tests=(ACC + "test_accumulated_steps_equal_one_big_batch[DDP, 1 x 4 x 2 ranks]",),
    ),
    Mutant(
        id="accum-mean-of-means",
        file="recipes/accumulate_and_clip.py",
        old='reduction="sum")\n                    accelerator.backward(micro_sum * scale)',
        new='reduction="mean")\n                    accelerator.backward(micro_sum)',
        what="accumulation as a mean of per-micro-batch means (over-weights the tokens of short rows)",
        tests=(ACC + "test_accumulated_steps_equal_one_big_batch[1 process, 2 x 4]",),
    ),
    Mutant(
        id="clip-per-micro-batch",
        file="recipes/accumulate_and_clip.py",
        old="                loss_sum += micro_sum.detach()\n            micro_batches = []",
        new=("                loss_sum += micro_sum.detach()\n"
             "                accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)\n"
             "            micro_batches = []"),
        what="clipping after every micro-batch (a partial gradient) instead of once on the full gradient",
        tests=(ACC + "test_accumulated_steps_equal_one_big_batch[1 process, 2 x 4]",),
    ),
    Mutant(
        id="grad-norm-post-clip",
        file="recipes/accumulate_and_clip.py",
        old="update(grad_norm=as_float(grad_norm), grad_norm_after_clip",
        new="update(grad_norm=as_float(clipped_norm), grad_norm_after_clip",
        what="the logged grad_norm is the post-clip norm, not the pre-clip one",
        tests=(ACC + "test_clipping_bounds_the_full_gradient_and_logs_the_pre_clip_norm[1 process, 2 x 4]",),
    ),
    Mutant(
        id="clip-after-step-train",
        file="recipes/train.py",
        old=("    grad_norm = run.accelerator.clip_grad_norm_(run.model.parameters(), max_norm)\n"
             "    run.optimizer.step()\n"),
        new=("    run.optimizer.step()\n"
             "    grad_norm = run.accelerator.clip_grad_norm_(run.model.parameters(), max_norm)\n"),
        what="train.py clips after the optimizer step: the update is unclipped",
        tests=("tests/test_benchmarks.py::test_the_plain_loop_trains_exactly_what_train_py_trains",),
        note="the plain loop clips before its step; on train_run's debug job the pre-clip norm is above "
             "--max_grad_norm 1.0 in 42 of 60 steps (measured 2026-12-05, 1 process, same data and options)",
    ),
    Mutant(
        id="nonfinite-limit-off-by-one",
        file="recipes/train.py",
        old="return self.deepspeed or self.in_a_row >= self.limit",
        new="return self.deepspeed or self.in_a_row > self.limit",
        what="the run stops after max_nonfinite_steps + 1 non-finite steps in a row, not max_nonfinite_steps",
        tests=(ACC + "test_nonfinite_losses_in_a_row_stop_the_run",),
    ),
    # ---- the LR schedule ----
    Mutant(
        id="warmup-off-by-one",
        file="common/model.py",
        old="num_warmup_steps=cfg.warmup_steps,",
        new="num_warmup_steps=cfg.warmup_steps + 1,",
        what="the warmup is one step longer than --warmup_steps",
        tests=("tests/test_schedule.py",),
    ),
    Mutant(
        id="resume-schedule-off-by-one",
        file="train_extras/resume/checkpoint.py",
        old="base * lr_at(inner.last_epoch)",
        new="base * lr_at(inner.last_epoch + 1)",
        what="a resumed run's first step uses the schedule's lr one step ahead",
        tests=("tests/test_checkpoint.py::test_resume_is_exact_on_one_process",),
        note="the logged lr cannot show it (LambdaLR recomputes it at the next step): the resumed losses do",
    ),
    Mutant(
        id="fp16-skip-not-detected-train",
        file="recipes/train.py",
        old="skipped = self.scale < before",
        new="skipped = self.scale > before",
        what="train.py misses the fp16 scaler's skipped steps: the schedule advances on them and they are not counted",
        tests=("tests/test_precision.py::test_fp16_with_accumulation_and_clipping_unscales_once",),
    ),
    Mutant(
        id="fp16-recipe-trusts-skip-flag",
        file="recipes/fp16_scaler.py",
        old="if accelerator.scaler.get_scale() < scale_before:",
        new="if accelerator.optimizer_step_was_skipped:",
        what="fp16_scaler.py trusts accelerate's skip flag, which a fused AdamW's skip does not set",
        tests=("tests/test_precision.py::test_fp16_recipe_skips_overflowed_steps",),
    ),
    # ---- data order, resume position, RNG ----
    Mutant(
        id="epoch-order-ignores-epoch",
        file="common/data.py",
        old="np.random.default_rng([self.seed, self.epoch])",
        new="np.random.default_rng(self.seed)",
        what="every epoch is shuffled in the same order",
        tests=("tests/test_data.py::test_epoch_sampler_depends_on_seed_and_epoch_only",),
    ),
    Mutant(
        id="skip-not-reset-next-epoch",
        file="recipes/train.py",
        old="skip, epoch = 0, epoch + 1",
        new="epoch = epoch + 1",
        what="a resumed run skips its micro-batches again at the start of every later epoch",
        tests=("tests/test_checkpoint.py::test_resume_just_before_an_epoch_boundary_with_workers",),
    ),
    Mutant(
        id="resume-position-world",
        file="train_extras/resume/checkpoint.py",
        old='samples_into_epoch = skip * saved_world * saved_cfg["micro_batch_size"]',
        new='samples_into_epoch = skip * saved_cfg["micro_batch_size"]',
        what="the data position moved to another world size forgets the saved run's ranks",
        tests=("tests/test_resilience.py::test_a_ddp_checkpoint_of_2_ranks_resumes_in_one_process",),
    ),
    Mutant(
        id="cpu-peak-draws-global-rng",
        file="train_extras/observe/metrics.py",
        old="probe = torch.randn(256, 256, device=device, dtype=dtype, generator=rng)",
        new="probe = torch.randn(256, 256, device=device, dtype=dtype)",
        what="the start-up matmul measurement draws from the global RNG (after set_seed: other initial weights)",
        tests=("tests/test_observability.py::test_measuring_the_cpu_ceiling_leaves_the_global_rng_alone",),
    ),
    # ---- checkpoints: rotation, atomic commits ----
    Mutant(
        id="rotation-text-order",
        file="train_extras/resume/checkpoint.py",
        old="found.append((int(match.group(1)), path))",
        new="found.append((match.group(1), path))",
        what="checkpoints ordered by step as text: rotation deletes step_10 before step_9, auto resumes step_9",
        tests=("tests/test_checkpoint.py::test_rotation_keeps_the_newest_by_step_number_and_auto_resumes",),
    ),
    Mutant(
        id="rotation-deletes-newest",
        file="train_extras/resume/checkpoint.py",
        old="for old in mine[:-keep]:",
        new="for old in mine[keep:]:",
        what="rotation deletes the newest checkpoints past --save_total_limit instead of the oldest",
        tests=("tests/test_checkpoint.py::test_rotation_keeps_the_newest_by_step_number_and_auto_resumes",),
    ),
    Mutant(
        id="rotation-takes-another-runs",
        file="train_extras/resume/checkpoint.py",
        old="(mine if run is not None and _saved(path).get(\"run_id\") == run else others).append(path)",
        new="mine.append(path)",
        what="rotation deletes another run's checkpoints in the folder (issue 42), not only this run's",
        tests=("tests/test_output_folder.py::test_rotation_removes_only_this_runs_checkpoints_and_says_so_once",),
    ),
    Mutant(
        id="rotation-not-atomic",
        file="train_extras/resume/checkpoint.py",
        old="    path.rename(trash)\n    shutil.rmtree(trash)",
        new="    shutil.rmtree(path)",
        what="rotation removes an old checkpoint in place: a crash leaves a half-deleted step_N that looks complete",
        tests=("tests/test_resilience.py::test_a_crash_at_any_phase_of_a_save_keeps_the_older_checkpoints_and_auto_"
               "finds_the_newest[during_rotation]",),
    ),
    Mutant(
        id="export-swap-not-atomic",
        file="common/files.py",
        old="    if not path.exists():\n        new.rename(path)\n",
        new="    if path.exists():\n        shutil.rmtree(path)\n    if not path.exists():\n        new.rename(path)\n",
        what="the export replaces model/ by deleting it and renaming the new one in (missing, or half, in between)",
        tests=("tests/test_export_atomic.py::test_a_kill_at_any_moment_of_an_export_leaves_the_old_or_the_new_one_"
               "whole[export_after_swap]",),
    ),
    # ---- the start-up guard and the strategies' settings ----
    Mutant(
        id="guard-world-size",
        file="common/guard.py",
        old='if world != asked["world_size"]:',
        new='if world > asked["world_size"]:',
        what="the guard no longer stops N processes that each run alone (no GPU backend found)",
        tests=("tests/test_guard.py::test_multi_gpu_config_without_gpus_is_refused",),
        timeout=1500,
        note="caught only when the 2 lone processes end (ddp.py's 720 default steps): slow, not a hang",
    ),
    Mutant(
        id="guard-deepspeed-fallback",
        file="common/guard.py",
        old='if asked["strategy"] == "DEEPSPEED" and dtype != DistributedType.DEEPSPEED:',
        new='if asked["strategy"] == "DEEPSPEED" and dtype == DistributedType.NO:',
        what="a DeepSpeed launch that accelerate ran as multi-process DDP passes the guard",
        tests=("tests/test_guard.py::test_deepspeed_requested_but_not_running_is_refused",),
    ),
    Mutant(
        id="fsdp-reduce-dtype",
        file="train_extras/parallel/fsdp_settings.py",
        old="reduce_dtype=torch.float32, output_dtype=compute)",
        new="reduce_dtype=compute, output_dtype=compute)",
        what="train.py's FSDP2 reduces gradients in bf16/fp16 (the focused recipe still in fp32)",
        tests=(SETTINGS + "test_the_recipe_writes_the_policies_train_py_uses",),
    ),
    Mutant(
        id="fsdp-offload-pinned",
        file="train_extras/parallel/fsdp_settings.py",
        old="return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())",
        new="return CPUOffloadPolicy()",
        what="FSDP2 CPU offload pins host memory without a GPU (accelerate's default: fails on the first copy)",
        tests=(SETTINGS + "test_the_recipe_writes_the_policies_train_py_uses",),
    ),
    Mutant(
        id="deepspeed-clip-rule",
        file="train_extras/parallel/deepspeed_settings.py",
        old="elif float(clip) != max_grad_norm:",
        new="elif float(clip) > max_grad_norm:",
        what="a DeepSpeed JSON that clips lower than --max_grad_norm silently wins",
        tests=(SETTINGS + "test_deepspeed_clipping_is_the_same_rule",),
    ),
    Mutant(
        id="deepspeed-weights-dtype",
        file="train_extras/parallel/deepspeed_settings.py",
        old="return PRECISION_DTYPES.get(accelerator.mixed_precision, torch.float32)",
        new="return torch.float32",
        what="under a bf16/fp16 DeepSpeed engine the model is loaded in fp32 (twice the host memory while loading)",
        tests=("tests/test_finetune.py::test_the_model_is_built_in_fp32_except_under_a_16_bit_deepspeed_engine",),
    ),
    Mutant(
        id="export-dtype-fp32",
        file="common/export.py",
        old="dtype or PRECISION_DTYPES.get(accelerator.mixed_precision, torch.float32)",
        new="dtype or torch.float32",
        what="the export ignores the run's precision: a bf16 run exports fp32",
        tests=("tests/test_recipes.py::test_baseline_bf16",),
    ),
    # ---- the memory planner ----
    Mutant(
        id="planner-zero1-optimizer-unsharded",
        file="tools/plan/states.py",
        old='"optimizer", "rest", 12 * P / (W if stage >= 1 else 1),',
        new='"optimizer", "rest", 12 * P / (W if stage >= 2 else 1),',
        what="the planner's textbook ZeRO-1 keeps the whole optimizer state per GPU (12 bytes/param, not 12/W)",
        tests=(PLAN + "test_textbook_7b_on_8_gpus",),
    ),
    Mutant(
        id="planner-muon-bytes",
        file="tools/plan/states.py",
        old='"optimizer", "rest", 4 * muon_params,',
        new='"optimizer", "rest", 8 * muon_params,',
        what="the planner counts Muon's one fp32 momentum as AdamW's two states (8 bytes/param)",
        tests=(PLAN + "test_muon_states_counted_on_three_families",),
    ),
    Mutant(
        id="planner-hsdp-shard-group",
        file="tools/plan/states.py",
        old="W = min(world_size, gpus_per_node or GPUS_PER_NODE)",
        new="W = world_size",
        what="the planner's HSDP shards over every GPU of every machine instead of one machine's",
        tests=(PLAN + "test_hsdp_holds_per_gpu_what_full_shard_over_one_machine_holds",),
    ),
    # ---- Muon and the chunked loss ----
    Mutant(
        id="muon-takes-the-head",
        file="train_extras/muon.py",
        old="    outside |= {id(head.weight)} if head is not None else set()\n",
        new="",
        what="Muon takes the (untied) output head as a hidden matrix",
        tests=("tests/test_muon.py::test_muon_takes_the_hidden_matrices_only",),
    ),
    Mutant(
        id="muon-takes-3d-experts",
        file="train_extras/muon.py",
        old="p.requires_grad and p.ndim == 2 and id(p)",
        new="p.requires_grad and p.ndim >= 2 and id(p)",
        what="Muon takes the fused 3-D expert tensors too (it orthogonalises matrices only)",
        tests=("tests/test_muon.py::test_muon_takes_the_hidden_matrices_only",),
    ),
    Mutant(
        id="chunked-mean-counts-ignored",
        file="train_extras/chunked_loss.py",
        old='total if reduction == "sum" else total / (labels != -100).sum()',
        new='total if reduction == "sum" else total / labels.numel()',
        what="the chunked loss's mean divides by every position, ignored (-100) ones included",
        tests=("tests/test_muon.py::test_chunked_loss_equals_the_plain_loss",),
    ),
    # ---- documents: masks, conversations, mixtures, held-out data ----
    Mutant(
        id="doc-positions-no-block-restart",
        file="train_extras/data/packing.py",
        old="return offsets - np.maximum(document_start, begin)",
        new="return offsets - document_start",
        what="a document carried over into the next block does not start that block at position 0",
        tests=(DOCS + "test_positions_restart_at_each_document_and_at_each_block",),
    ),
    Mutant(
        id="doc-positions-block-offset",
        file="train_extras/data/packing.py",
        old="begin = index * (self.seq_len + 1)",
        new="begin = index * self.seq_len",
        what="a block's position ids are computed at the wrong stream offset (blocks are seq_len + 1 long)",
        tests=(DOCS + "test_packed_text_blocks_carry_position_ids_only_with_the_document_mask",),
    ),
    Mutant(
        id="doc-mask-fallback-keeps-positions",
        file="train_extras/document_mask.py",
        old='return {"position_ids": None}',
        new="return {}",
        what="a family whose documents cannot be kept apart trains with restarted positions (half a mask), not as "
             "--document_mask false",
        tests=("tests/test_document_mask.py::test_auto_keeps_each_familys_documents_apart_where_it_can_and_says_why_not",),
    ),
    Mutant(
        id="assistant-labels-off-by-one",
        file="train_extras/data/packing.py",
        old="labels[torch.from_numpy(self.targets[index][1:] == 0)] = -100",
        new="labels[torch.from_numpy(self.targets[index][:-1] == 0)] = -100",
        what="packed conversations mask the labels by the input token's role, one position off",
        tests=(DOCS + "test_labels_are_minus_100_exactly_where_the_next_token_is_not_the_assistants[True]",),
    ),
    Mutant(
        id="assistant-prefix-off-by-one",
        file="train_extras/data/render.py",
        old="mask[len(before): len(through)] = [1] * (len(through) - len(before))",
        new="mask[len(before) - 1: len(through) - 1] = [1] * (len(through) - len(before))",
        what="the prefix-difference reading of the assistant's tokens starts one token early",
        tests=(DOCS + "test_the_template_markers_and_the_prefix_differences_agree",),
    ),
    Mutant(
        id="mixture-weights-by-name",
        file="train_extras/data/assemble.py",
        old='weights = np.array([s["weight"] for s in spec["sources"]])',
        new='weights = np.array([s["weight"] for s in sorted(spec["sources"], key=lambda s: s["name"])])',
        what="the mixture's weights are taken in name order while the sources stay in file order (weights swapped)",
        tests=(DOCS + "test_documents_are_drawn_by_weight",),
    ),
    Mutant(
        id="heldout-eval-files-ignored",
        file="common/data.py",
        old="if cfg.eval_split or cfg.eval_data_files:",
        new="if cfg.eval_split:",
        what="--eval_data_files is ignored: 2% of the training documents are held out instead",
        tests=("tests/test_data.py::test_eval_data_files_are_the_held_out_set",),
    ),
    # ---- evaluation and metrics ----
    Mutant(
        id="eval-mixture-mean-of-means",
        file="train_extras/data/assemble.py",
        old='loss = sum(r["loss"] * r["tokens"] for r in scores.values()) / tokens if tokens else float("nan")',
        new='loss = sum(r["loss"] for r in scores.values()) / len(scores) if tokens else float("nan")',
        what="a mixture's held-out loss is the mean of the sources' means, not the token mean over all of them",
        tests=(DOCS + "test_a_mixture_logs_each_sources_held_out_loss_and_resumes_exactly",),
    ),
    Mutant(
        id="eval-row-mean-of-means",
        file="common/model.py",
        old='loss = loss_sum / token_count if token_count else float("nan")',
        new='loss = sum(s / t for s, t in by_index.values() if t) / len(by_index) if token_count else float("nan")',
        what="the held-out loss is the mean of per-row means (rows with few targets over-weighted)",
        tests=("tests/test_seams.py::test_the_held_out_loss_weights_every_target_token_alike_whatever_its_row_holds",),
        note="survived the first run (2026-12-05): packed text blocks all have seq_len targets (mean of means = "
             "token mean) and no test pinned the held-out loss of rows with unequal targets; test_seams.py does now",
    ),
    Mutant(
        id="eval-repeats-counted",
        file="common/model.py",
        old="by_index = {row[0]: row[1:] for row in (torch.cat(rows).tolist() if rows else [])}",
        new="by_index = {i: row[1:] for i, row in enumerate(torch.cat(rows).tolist() if rows else [])}",
        what="held-out rows gathered from several ranks are counted as often as they come (repeats, TP copies)",
        tests=("tests/test_hsdp.py::test_losses_match_one_process",),
    ),
    Mutant(
        id="interval-per-device",
        file="train_extras/observe/metrics.py",
        old="per_device = tokens_per_s / world_size",
        new="per_device = tokens_per_s",
        what="tokens/s per device (and MFU) are the global figures, world_size times too high",
        tests=("tests/test_observability.py::test_interval_arithmetic",),
    ),
    Mutant(
        id="tokens-per-step-block-length",
        file="recipes/train.py",
        old="tokens_per_step = (cfg.micro_batch_size * cfg.seq_len * cfg.gradient_accumulation_steps",
        new="tokens_per_step = (cfg.micro_batch_size * (cfg.seq_len + 1) * cfg.gradient_accumulation_steps",
        what="throughput and tokens_seen count a block's seq_len + 1 tokens instead of its seq_len trained positions",
        tests=("tests/test_recipes.py::test_train_summary_complete",),
    ),
    Mutant(
        id="redact-key-names-lost",
        file="train_extras/observe/tracking.py",
        old="return {k: redact(v, env_secrets, str(k)) for k, v in value.items()}",
        new="return {k: redact(v, env_secrets) for k, v in value.items()}",
        what="redaction ignores key names: a value under api_key or password that looks like no known token leaks",
        tests=("tests/test_observability.py::test_redaction_rules",),
    ),
    # ---- the seams other helpers are testing now (tests/test_seams_moe.py, tests/test_seams.py) ----
    Mutant(
        id="seam-moe-accum-aux-logged",
        file="recipes/train.py",
        old="aux_loss = loss_and_votes[2] / (accumulation * accelerator.num_processes) if with_aux else None",
        new="aux_loss = loss_and_votes[2] / accelerator.num_processes if with_aux else None",
        what="MoE x accumulation: the logged router loss is the sum over the step's micro-batches, not their mean",
        tests=("tests/test_seams_moe.py::test_the_router_loss_under_gradient_accumulation",),
    ),
    Mutant(
        id="seam-moe-accum-aux-objective",
        file="recipes/train.py",
        old='accelerator.backward(micro_sum * scale + run.route["coef"] * aux)',
        new='accelerator.backward((micro_sum + run.route["coef"] * aux) * scale)',
        what="MoE x accumulation: the router loss is normalised by the step's tokens like the LM loss (vanishes)",
        tests=("tests/test_seams_moe.py::test_the_router_loss_under_gradient_accumulation",),
    ),
    Mutant(
        id="seam-moe-expert-load-cumulative",
        file="train_extras/observe/run_record.py",
        old='slots, self.slots = self.accelerator.reduce(self.slots, "sum"), None',
        new='slots = self.accelerator.reduce(self.slots, "sum")',
        what="MoE: the expert load logged per interval is cumulative since the start, not the interval's own",
        tests=("tests/test_seams_moe.py::test_each_interval_logs_the_load_routed_in_that_interval",),
    ),
    Mutant(
        id="seam-moe-document-mask-dropped",
        file="train_extras/moe.py",
        old='input_ids, labels, "sum", position_ids,',
        new='input_ids, labels, "sum", None,',
        what="MoE x document masks: the MoE loss path drops the position ids (documents see each other)",
        tests=("tests/test_seams_moe.py::test_packed_documents_reach_the_moe_model_with_their_own_positions",),
    ),
    Mutant(
        id="seam-mixture-eval-on-train-rows",
        file="train_extras/data/assemble.py",
        old="held_out[name] = packing.as_dataset(evaluated, tokenizer, cfg, kind)",
        new="held_out[name] = packing.as_dataset(train, tokenizer, cfg, kind)",
        what="a mixture's per-source eval scores the source's training rows, not its held-out rows",
        tests=("tests/test_seams.py::test_a_mixture_scores_each_source_on_its_own_held_out_rows",),
    ),
    Mutant(
        id="best-fit-label-across-examples",
        file="train_extras/data/packing.py",
        old="labels[torch.from_numpy(~trained[1:] | first[1:])] = -100",
        new="labels[torch.from_numpy(~trained[1:])] = -100",
        what="a best-fit row trains an example's last token to predict the next example's first (text: "
             "conversations and completions never train a first token)",
        tests=("tests/test_documents.py::test_best_fit_keeps_every_example_whole_and_pads_little",),
    ),
    Mutant(
        id="completion-loss-on-the-prompt",
        file="train_extras/data/render.py",
        old='start = common_prefix(tokenizer(prompt)["input_ids"], ids) if completion_only else 0',
        new='start = 0',
        what="prompt/completion text trains the prompt too",
        tests=("tests/test_formats.py::test_each_format_trains_exactly_the_tokens_trl_trains",),
    ),
    Mutant(
        id="tool-schemas-not-given-to-the-template",
        file="train_extras/data/formats.py",
        old="if tools and example:",
        new="if tools and not example:",
        what="a row's tools column never reaches the chat template",
        tests=("tests/test_formats.py::test_each_format_trains_exactly_the_tokens_trl_trains",),
    ),
    Mutant(
        id="seam-chunked-head-bias-dropped",
        file="train_extras/chunked_loss.py",
        old="flat[i:i + size], head.weight, head.bias, labels[i:i + size]",
        new="flat[i:i + size], head.weight, None, labels[i:i + size]",
        what="the chunked loss drops the output head's bias",
        tests=("tests/test_seams.py::test_the_chunked_loss_on_a_head_with_a_bias_equals_the_plain_loss",),
    ),
    Mutant(
        id="seam-resume-missing-option-key",
        file="train_extras/resume/checkpoint.py",
        old='**BEFORE_THE_OPTION, **meta.get("config", {})}',
        new='**meta.get("config", {}), **BEFORE_THE_OPTION}',
        what="the stand-ins for options a checkpoint predates override what it recorded (masked reads as unmasked)",
        tests=("tests/test_seams.py::test_a_checkpoint_from_before_the_later_options_resumes_with_their_defaults_exactly",),
    ),
    Mutant(
        id="seam-changed-data-not-checked",
        file="recipes/train.py",
        old="if resume_meta is not None and not cfg.eval_only:  # a file rewritten in place",
        new="if resume_meta is not None and cfg.eval_only:  # a file rewritten in place",
        what="a training resume no longer compares the data it built with the checkpoint's (rewritten files pass)",
        tests=("tests/test_seams.py::test_a_training_resume_on_other_data_is_refused_before_any_model_and_leaves_the_checkpoint",),
    ),
    Mutant(
        id="seam-export-leftovers-kept",
        file="common/export.py",
        old="recover_dir(out_dir)  # what a killed export left",
        new="pass  # what a killed export left",
        what="an export over a killed export's leftovers does not clear them first (stale files can be published)",
        tests=("tests/test_seams.py::test_an_export_over_a_killed_exports_leftovers_is_the_clean_export",),
    ),
    Mutant(
        id="seam-moe-accum-aux-divided-twice",
        file="recipes/train.py",
        old='accelerator.backward(micro_sum * scale + run.route["coef"] * aux)',
        new='accelerator.backward(micro_sum * scale + run.route["coef"] * aux / accumulation)',
        what="MoE x accumulation: the router loss in the objective is divided by the accumulation steps twice",
        tests=("tests/test_seams_moe.py::test_the_router_loss_under_gradient_accumulation",),
    ),
    Mutant(
        id="seam-moe-coef-zero-ignored",
        file="train_extras/moe.py",
        old="if route is not None and cfg.router_aux_loss_coef is not None:",
        new="if route is not None and cfg.router_aux_loss_coef:",
        what="MoE: --router_aux_loss_coef 0 falls back to the config's coefficient instead of turning the loss off",
        tests=("tests/test_seams_moe.py::test_a_router_weight_of_0_is_the_runs_not_the_configs",),
    ),
    Mutant(
        id="seam-moe-load-one-rank",
        file="train_extras/observe/run_record.py",
        old='slots, self.slots = self.accelerator.reduce(self.slots, "sum"), None',
        new="slots, self.slots = self.slots, None",
        what="MoE x strategies: the expert load logged is rank 0's routing alone, not every rank's",
        tests=("tests/test_moe.py::test_a_steps_router_loss_and_expert_load_are_every_ranks[mixtral-ddp.yaml]",),
    ),
    Mutant(
        id="seam-moe-aux-logged-world-twice",
        file="recipes/train.py",
        old="aux_loss = loss_and_votes[2] / (accumulation * accelerator.num_processes) if with_aux else None",
        new="aux_loss = loss_and_votes[2] / (accumulation * accelerator.num_processes ** 2) if with_aux else None",
        what="MoE x strategies: the logged router loss is divided by the world size twice",
        tests=("tests/test_moe.py::test_a_steps_router_loss_and_expert_load_are_every_ranks[mixtral-ddp.yaml]",),
    ),
    Mutant(
        id="seam-resume-defaults-dropped",
        file="train_extras/resume/checkpoint.py",
        old='return {**dataclasses.asdict(type(cfg)()), **BEFORE_THE_OPTION,',
        new='return {**BEFORE_THE_OPTION,',
        what="resume x later options: an option a checkpoint does not record is skipped, not compared as its default",
        tests=("tests/test_seams.py::test_a_later_option_a_checkpoint_does_not_record_counts_as_its_default",
               "tests/test_release_checkpoints.py::test_an_option_the_checkpoint_does_not_record_takes_its_default"),
    ),
    Mutant(
        id="seam-resume-missing-key-raises",
        file="train_extras/resume/checkpoint.py",
        old="    saved_cfg = saved_options(meta, cfg)\n    return {key: [saved_cfg[key], getattr(cfg, key)]",
        new='    saved_cfg = meta.get("config", {})\n    return {key: [saved_cfg[key], getattr(cfg, key)]',
        what="resume x options added later: the schedule options a resume may change are read from checkpoint.json "
             "alone (KeyError on one it predates)",
        tests=("tests/test_seams.py::test_a_checkpoint_from_before_the_later_options_resumes_with_their_defaults_exactly",),
    ),
]
