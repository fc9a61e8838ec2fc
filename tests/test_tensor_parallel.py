"""Tensor parallel (2 CPU processes) and 2D FSDP2 x TP (4 CPU processes), through the CPU harness.

Every run starts from the 1-process reference's initial weights (seed 1234, debug preset) with the
same global batch of the same samples, in fp32, so its losses must equal the reference's up to the
order of floating-point sums. Each run is launched once; the tests read its run_summary.json."""

import fnmatch
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.parallelism_config import ParallelismConfig
from transformers import (AutoModelForCausalLM, Gemma3TextConfig, GPTNeoXConfig, LlamaConfig, MixtralConfig,
                          Olmo2Config, OlmoeConfig, Phi3Config, Qwen3Config, Qwen3MoeConfig)

from common.config import ConfigError, data_parallel_size
from common.data import build_tokenizer
from common.model import _split_by_mesh, model_config
from train_extras.parallel import tensor_parallel
from train_extras.resume.checkpoint import check_compatible, verify
from train_extras.options import TrainConfig
from conftest import (CORE_DEBUG_ARGS, DEBUG_ARGS, HARNESS, ROOT, SYNTHETIC, TRAIN_ARGS, TWO_PROCESS_LAUNCH, Run,
                      check_exact_resume, check_export_reproduces_model, check_loss_goes_down, launch, reference_run)

TP_LAUNCH = TWO_PROCESS_LAUNCH + ["--parallelism_config_tp_size", "2"]
FSDP_TP_LAUNCH = ["--num_processes", "4", "--num_cpu_threads_per_process", "1", "--mixed_precision", "no",
                  "--parallelism_config_dp_shard_size", "2", "--parallelism_config_tp_size", "2"]
# (recipe, config, launch arguments, recipe arguments). Global batch 8 everywhere, as the 1-process
# reference's: the TP ranks share one batch (train.py: 2 accumulated micro-batches of 4); the 2D run
# has 2 data-parallel groups of 2 accumulated micro-batches of 2.
def accumulate(micro: int, steps: int) -> list[str]:
    return ["--micro_batch_size", str(micro), "--gradient_accumulation_steps", str(steps)]


RUNS = {
    "tensor_parallel.py/tp.yaml": ("tensor_parallel.py", "tp.yaml", TP_LAUNCH, CORE_DEBUG_ARGS),  # no checkpoints
    "train.py/tp.yaml": ("train.py", "tp.yaml", TP_LAUNCH, TRAIN_ARGS + accumulate(4, 2)),
    # 4 processes on 2 cores are slow: 30 steps, saved at 15
    "train.py/fsdp_tp.yaml": ("train.py", "fsdp_tp.yaml", FSDP_TP_LAUNCH,
                              TRAIN_ARGS + accumulate(2, 2) + ["--max_steps", "30", "--save_every", "15",
                                                                "--eval_every", "15"]),
}
# bf16 (autocast around the TP model), short: bf16 is slow on CPUs without bf16 units
BF16_TP_RUN = ("train.py", "tp.yaml", TP_LAUNCH + ["--mixed_precision", "bf16"],
               DEBUG_ARGS + ["--max_steps", "20", "--eval_every", "10"])


def launch_tp(name, args, hf_home, check=True):
    recipe, config, launch_args, _ = BF16_TP_RUN if name == "bf16" else RUNS[name]
    return launch(recipe, args, hf_home, config=config, launch_args=launch_args, check=check,
                  env=HARNESS)


@pytest.fixture(scope="session")
def tp_runs(tmp_path_factory, hf_home):
    runs = {}

    def get(name: str) -> Run:
        if name not in runs:
            out = tmp_path_factory.mktemp(name.replace("/", "__"))
            args = (BF16_TP_RUN if name == "bf16" else RUNS[name])[3]
            runs[name] = Run(out, launch_tp(name, args + ["--output_dir", str(out)], hf_home))
        return runs[name]

    return get


# Which module of a Llama block is split how: (placement, dimension halved by TP).
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")


@pytest.mark.parametrize("name", RUNS)
def test_weights_are_dtensors_sharded_over_the_tp_mesh(name, tp_runs):
    run = tp_runs(name)
    layout = run.final[0]["tensor_parallel_parameters"]
    two_d = "fsdp_tp" in name
    expected_mesh = {"dp_shard": 2, "tp": 2} if two_d else {"tp": 2}
    checked = 0
    for pname, row in layout.items():
        module = pname.split(".")[-2]
        global_shape, local_shape = row["global_shape"], row["local_shape"]
        if module in COLWISE + ROWWISE:
            assert row["mesh"] == expected_mesh, (pname, row)
            tp_dim = 0 if module in COLWISE else 1
            assert row["placements"][-1] == f"S({tp_dim})", (pname, row)  # TP: the inner mesh dimension
            expected = list(global_shape)
            expected[tp_dim] //= 2
            if two_d:
                expected[0] //= 2  # FSDP2 splits the TP shard again along dim 0
            assert local_shape == expected, (pname, row)
            checked += 1
        elif not two_d and name.startswith("train.py"):
            # parallelize_module applies only the model's base_model_tp_plan: the rest stays whole
            assert row["placements"] == [] and local_shape == global_shape, (pname, row)
    assert checked == 2 * len(COLWISE + ROWWISE)  # every projection of both layers of the debug preset
    if name.startswith("tensor_parallel.py"):
        # transformers' tp_plan="auto" also splits the embedding and the LM head over the 259-token vocabulary
        for pname in ("model.embed_tokens.weight", "lm_head.weight"):
            assert layout[pname]["local_shape"] == [130, 64] and layout[pname]["placements"] == ["S(0)"]
    ranks = run.parameters_per_rank
    assert len(ranks) == (4 if two_d else 2)
    assert all(rank["local_numel"] < rank["global_numel"] for rank in ranks)
    # Every element of a TP-sharded matrix lives on exactly one rank; the rest (whole under TP, or
    # split by FSDP2 only in 2D) once per TP rank of a data group.
    numel = lambda shape: torch.Size(shape).numel()  # noqa: E731
    tp_sharded = sum(numel(row["global_shape"]) for row in layout.values() if row["mesh"].get("tp"))
    rest = sum(numel(row["global_shape"]) for row in layout.values() if not row["mesh"].get("tp"))
    assert tp_sharded + rest == ranks[0]["global_numel"]
    assert sum(rank["local_numel"] for rank in ranks) == tp_sharded + 2 * rest


@pytest.mark.parametrize("name", RUNS)
def test_losses_match_one_process_and_go_down(name, tp_runs, train_run, train_run_unmasked):
    run = tp_runs(name)
    # tensor_parallel.py packs without document masks: its reference is train.py's without them
    train_run = reference_run(name.split("/")[0], train_run, train_run_unmasked)
    reference = [row["loss"] for row in train_run.summary["losses"]]
    losses = [row["loss"] for row in run.summary["losses"]]
    # Steps 1-5 are warm-up steps, whose LR does not depend on --max_steps (the 2D run is shorter).
    assert losses[:5] == pytest.approx(reference[:5], abs=1e-5, rel=0)
    assert reference[4] < reference[0] - 0.2  # the compared steps really moved the model
    same_schedule = len(losses) == len(reference)
    if same_schedule:
        assert losses == pytest.approx(reference, abs=1e-4, rel=0)  # all 60 stay together (measured: 7e-7)
    check_loss_goes_down(run.summary)
    if name.startswith("train.py"):
        # the gradient itself, not only the loss (AdamW would hide a constant factor on the gradient)
        norms = [row["grad_norm"] for row in run.summary["losses"][:5]]
        assert norms == pytest.approx([row["grad_norm"] for row in train_run.summary["losses"][:5]], rel=1e-4)
    # held-out loss: each sample counted once although the TP ranks hold the same rows
    evals = run.summary["eval"] if same_schedule else run.summary["eval"][:1]  # step 0 at least
    reference_evals = train_run.summary["eval"][:len(evals)]
    assert [(row["step"], row["tokens"]) for row in evals] == [(row["step"], row["tokens"]) for row in reference_evals]
    assert [row["loss"] for row in evals] == pytest.approx([row["loss"] for row in reference_evals], abs=1e-5, rel=0)


@pytest.mark.parametrize("name", RUNS)
def test_setup_counts_data_parallel_ranks_only(name, tp_runs):
    setup = tp_runs(name).summary["setup"]
    two_d = "fsdp_tp" in name
    assert setup["world_size"] == (4 if two_d else 2)
    assert (setup["data_parallel_size"], setup["tensor_parallel_size"]) == ((2, 2) if two_d else (1, 2))
    assert setup["global_batch_sequences"] == 8  # as the 1-process reference
    assert setup["distributed_type"] == "MULTI_GPU"


def test_train_py_records_the_strategy_that_ran(tp_runs):
    tp, two_d = tp_runs("train.py/tp.yaml"), tp_runs("train.py/fsdp_tp.yaml")
    mesh = lambda run: (run.summary["setup"]["data_parallel_size"], run.summary["setup"]["tensor_parallel_size"])  # noqa: E731
    assert mesh(tp) == (1, 2) and tp.strategy["engine"] == "LlamaForCausalLM"
    assert mesh(two_d) == (2, 2) and two_d.strategy["engine"] == "fsdp2"
    assert two_d.strategy["reshard_after_forward"] is True
    # one parameter group per mesh: TP-split matrices with decay, the whole LM head with decay,
    # the whole norms and embedding without (fused AdamW refuses mixed groups)
    assert [g["weight_decay"] for g in tp.final[0]["optimizer_groups"]] == [0.1, 0.1, 0.0]
    # the copies TP keeps on every rank (norms, embedding, LM head) stayed bitwise equal
    for run in (tp, two_d):
        assert run.final[0]["tensor_parallel_replica_max_difference"] == 0.0


def test_bf16_under_tensor_parallel(tp_runs):
    """bf16 autocast wraps the TP model's forward; the probe (fp32, wrapper removed) must still
    reproduce the export, and the run must learn."""
    run = tp_runs("bf16")
    assert run.summary["setup"]["mixed_precision"] == "bf16"
    losses = [row["loss"] for row in run.summary["losses"]]
    assert len(losses) == 20 and sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    check_export_reproduces_model(run)


@pytest.mark.parametrize("name", RUNS)
def test_export_reloads_with_the_same_logits(name, tp_runs):
    check_export_reproduces_model(tp_runs(name))


@pytest.mark.parametrize("name, half", [("train.py/tp.yaml", 30), ("train.py/fsdp_tp.yaml", 15)])
def test_resume_is_exact(name, half, tp_runs, tmp_path, hf_home):
    full = tp_runs(name)
    step_half = full.output_dir / "checkpoints" / f"step_{half}"
    # model and optimizer shards by torch.distributed.checkpoint, one file per rank; RNG per rank
    shards = sorted(p.name for p in (step_half / tensor_parallel.SHARDED_STATE_DIR).glob("*.distcp"))
    world = full.summary["setup"]["world_size"]
    assert len(shards) == world and (step_half / tensor_parallel.SHARDED_STATE_DIR / ".metadata").is_file()
    rng_files = sorted(p.name for p in step_half.glob("random_states_*.pkl"))
    assert rng_files == [f"random_states_{r}.pkl" for r in range(world)]
    args = RUNS[name][3] + ["--resume_from_checkpoint", str(step_half), "--output_dir", str(tmp_path)]
    resumed = Run(tmp_path, launch_tp(name, args, hf_home))
    check_exact_resume(full, resumed, half)
    assert resumed.summary["eval"][-1]["loss"] == full.summary["eval"][-1]["loss"]
    check_export_reproduces_model(resumed)


# ---- in-process: the checks that run before any model is built ----

class StandIn(SimpleNamespace):
    """The attributes of an Accelerator that the checks read."""


def stand_in(tp=2, dp_shard=1, distributed_type="MULTI_GPU", mixed_precision="no"):
    pc = ParallelismConfig(dp_shard_size=dp_shard, tp_size=tp)
    return StandIn(parallelism_config=pc, num_processes=tp * dp_shard, mixed_precision=mixed_precision,
                   distributed_type=SimpleNamespace(value=distributed_type))


@pytest.mark.quick
@pytest.mark.parametrize("kwargs, options, message", [
    ({"tp": 3}, {}, "tp_size 3 does not divide the model's num_attention_heads (4)"),
    ({"mixed_precision": "fp16"}, {}, "fp16 is not supported with tensor parallelism"),
    ({"distributed_type": "FSDP", "dp_shard": 2}, {}, "tensor parallel configs use distributed_type MULTI_GPU"),
    ({}, {"compile": True}, "--compile is not tested with tensor parallelism"),
])
def test_impossible_tensor_parallel_setups_are_refused(kwargs, options, message):
    cfg = TrainConfig(preset="debug", **options)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tensor_parallel.check(stand_in(**kwargs), cfg, model_config(cfg, 259), "train.py")
    tensor_parallel.check(stand_in(), TrainConfig(preset="debug"), model_config(TrainConfig(preset="debug"), 259), "x")


def test_a_checkpoint_resumes_only_on_its_own_mesh(tp_runs):
    full = tp_runs("train.py/tp.yaml")
    step_half = full.output_dir / "checkpoints" / "step_30"
    cfg = TrainConfig(**{k: v for k, v in full.summary["setup"]["options"].items()})
    meta = verify(step_half, contents=False)
    check_compatible(step_half, cfg, stand_in(), meta)  # its own mesh: fine
    for other, seen in ((stand_in(tp=2, dp_shard=2), "this run has 2 x 2"),
                        (StandIn(parallelism_config=None, num_processes=2,
                                 distributed_type=SimpleNamespace(value="MULTI_GPU")),
                         "this run has 2 x 1")):
        with pytest.raises(ConfigError, match=f"saved with 1 data-parallel x 2 tensor-parallel ranks; {seen}"):
            check_compatible(step_half, cfg, other, meta)
    assert data_parallel_size(stand_in(tp=2, dp_shard=2)) == 2


@pytest.mark.quick
def test_optimizer_groups_split_by_mesh_only_when_there_are_dtensors():
    plain = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    assert _split_by_mesh(plain) == [plain]
    assert _split_by_mesh([]) == [[]]


# ---- newer dense families: the whole declared plan (Qwen3: replicated per-head q/k norms whose
# gradient is summed over the TP group; OLMo2: gathered q/k/v outputs for its full-width q/k norms,
# row-wise o_proj on a split input). Tiny, random-init (seed 0), saved folders; each (family,
# config) launched once against its own 1-process run (global batch 8, same samples, fp32). ----

VOCAB = 259  # the byte-level tokenizer
TINY = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=False,
            pad_token_id=0, eos_token_id=1)
DENSE_FAMILIES = {
    "qwen3": lambda: Qwen3Config(head_dim=16, **TINY),  # (its default head_dim is 128)
    "olmo2": lambda: Olmo2Config(**TINY),
}
FAMILY_CLASS = {"qwen3": "Qwen3ForCausalLM", "olmo2": "Olmo2ForCausalLM"}
FAMILY_ARGS = ["--data_files", SYNTHETIC, "--seq_len", "64", "--max_steps", "12", "--warmup_steps", "4",
               "--eval_every", "12", "--log_every", "6", "--sample_length", "8"]
FAMILY_LAUNCH = {"cpu.yaml": (["--num_cpu_threads_per_process", "2"], {}, accumulate(8, 1)),
                 "tp.yaml": (TP_LAUNCH, HARNESS, accumulate(4, 2)),
                 "fsdp_tp.yaml": (FSDP_TP_LAUNCH, HARNESS, accumulate(2, 2))}
FAMILY_RUNS = [(family, config) for family in DENSE_FAMILIES for config in ("tp.yaml", "fsdp_tp.yaml")]


@pytest.fixture(scope="session")
def dense_family_models(tmp_path_factory):
    """Each family as a saved Hugging Face folder, and the byte tokenizer in a folder of its own
    (beside a Qwen config, transformers would load Qwen's own tokenizer class: test_model_families.py)."""
    folders = {}
    for name, make in DENSE_FAMILIES.items():
        folders[name] = tmp_path_factory.mktemp(f"tp_family_{name}")
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(make()).save_pretrained(folders[name])
    folders["tokenizer"] = tmp_path_factory.mktemp("tp_family_tokenizer")
    build_tokenizer(TrainConfig()).save_pretrained(folders["tokenizer"])
    return folders


@pytest.fixture(scope="session")
def family_tp_runs(tmp_path_factory, hf_home, dense_family_models):
    runs = {}

    def get(family: str, config: str) -> Run:
        if (family, config) not in runs:
            out = tmp_path_factory.mktemp(f"tp_{family}__{config}")
            launch_args, env, batch = FAMILY_LAUNCH[config]
            args = FAMILY_ARGS + batch + ["--model_name_or_path", str(dense_family_models[family]),
                                          "--tokenizer_name_or_path", str(dense_family_models["tokenizer"]),
                                          "--output_dir", str(out)]
            runs[family, config] = Run(out, launch("train.py", args, hf_home, config=config,
                                                   launch_args=launch_args, env=env))
        return runs[family, config]

    return get


@pytest.mark.parametrize("family, config", FAMILY_RUNS)
def test_dense_family_matches_one_process(family, config, family_tp_runs):
    run, reference = family_tp_runs(family, config), family_tp_runs(family, "cpu.yaml")
    two_d = config == "fsdp_tp.yaml"
    setup = run.summary["setup"]
    assert (setup["world_size"], setup["data_parallel_size"], setup["tensor_parallel_size"]) == \
        ((4, 2, 2) if two_d else (2, 1, 2))
    assert setup["global_batch_sequences"] == 8 and run.final[0]["model_class"] == FAMILY_CLASS[family]
    losses = [row["loss"] for row in run.summary["losses"]]
    expected = [row["loss"] for row in reference.summary["losses"]]
    assert len(losses) == len(expected) == 12
    assert expected[-1] < expected[0] - 1.0, expected  # the compared steps really moved the model
    # the file's tolerances (the Llama runs above): steps 1-5 within 1e-5, all within 1e-4,
    # gradient norms within 1e-4 relative, held-out losses within 1e-5
    assert losses[:5] == pytest.approx(expected[:5], abs=1e-5, rel=0)
    assert losses == pytest.approx(expected, abs=1e-4, rel=0)
    norms = [row["grad_norm"] for row in run.summary["losses"]]
    assert norms == pytest.approx([row["grad_norm"] for row in reference.summary["losses"]], rel=1e-4)
    evals, reference_evals = run.summary["eval"], reference.summary["eval"]
    assert [(row["step"], row["tokens"]) for row in evals] == [(row["step"], row["tokens"]) for row in reference_evals]
    assert [row["loss"] for row in evals] == pytest.approx([row["loss"] for row in reference_evals], abs=1e-5, rel=0)
    # the copies TP keeps whole and unsplit (plain tensors) stayed bitwise equal
    assert run.final[0]["tensor_parallel_replica_max_difference"] == 0.0
    sample = run.summary["samples"][-1]  # generate ran through the TP model on every rank
    assert sample["text"].startswith(sample["prompt"]) and len(sample["text"]) > len(sample["prompt"])


def expected_placement(name: str, plan: dict, two_d: bool) -> tuple[list[str] | None, int | None]:
    """A parameter's placements under the family's declared plan, or (None, the dimension TP halves)."""
    module = name.rsplit(".", 1)[0].removeprefix("model.")
    style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(module, pattern)), None)
    if style is None:
        return (["S(0)"] if two_d else []), None  # whole on every TP rank (2D: split by FSDP2 only)
    if style == "replicated_with_grad_allreduce":
        return (["S(0)", "R"] if two_d else ["R"]), None  # a Replicate DTensor on the TP mesh
    return None, 0 if style.startswith("colwise") else 1


@pytest.mark.parametrize("family, config", FAMILY_RUNS)
def test_dense_family_parameters_are_placed_as_its_plan_says(family, config, family_tp_runs):
    run = family_tp_runs(family, config)
    two_d = config == "fsdp_tp.yaml"
    plan = DENSE_FAMILIES[family]().base_model_tp_plan
    layout = run.final[0]["tensor_parallel_parameters"]
    styles_seen = set()
    for name, row in layout.items():
        placements, tp_dim = expected_placement(name, plan, two_d)
        expected = list(row["global_shape"])
        if tp_dim is not None:
            expected[tp_dim] //= 2
            assert row["mesh"] == ({"dp_shard": 2, "tp": 2} if two_d else {"tp": 2}), (name, row)
            assert row["placements"][-1] == f"S({tp_dim})", (name, row)  # TP: the inner mesh dimension
            styles_seen.add("split")
        else:
            assert row["placements"] == placements, (name, row)
            styles_seen.add("R" if "R" in placements else "whole")
        if two_d:
            expected[0] = -(-expected[0] // 2)  # FSDP2 splits again along dim 0 (rank 0: 130 of 259 rows)
        assert row["local_shape"] == expected, (name, row)
    assert styles_seen == ({"split", "R", "whole"} if family == "qwen3" else {"split", "whole"})


@pytest.mark.parametrize("family, config", FAMILY_RUNS)
def test_dense_family_export_reloads_with_the_same_logits(family, config, family_tp_runs):
    """The full weights gathered from the shards and replicas, reloaded by plain transformers, give the
    trained model's logits (as check_export_reproduces_model, without its AutoTokenizer reload: beside
    an OLMo2 config, AutoTokenizer takes OLMo2's tokenizer class, not the ByT5Tokenizer the folder names)."""
    from probes.sitecustomize import PROBE_INPUT_IDS

    run = family_tp_runs(family, config)
    model = AutoModelForCausalLM.from_pretrained(run.summary["export"])
    assert type(model).__name__ == FAMILY_CLASS[family] and {p.dtype for p in model.parameters()} == {torch.float32}
    with torch.no_grad():
        logits = model(torch.tensor([PROBE_INPUT_IDS])).logits[0]
    assert (logits - torch.tensor(run.final[0]["probe_logits"])).abs().max().item() < 1e-5


def test_replicated_norm_gradients_are_summed_over_the_tp_group(dense_family_models, tmp_path):
    """2 gloo ranks (torchrun), 2 accumulated micro-batches: every gradient of the TP model equals
    the 1-process model's, and what both ranks hold whole (Qwen3's Replicate q/k norms included)
    is bitwise the same on both. (transformers' own replicated_with_grad_allreduce hook reduces
    the already accumulated gradient again: the q_norm gradients were 2.7e-3 off.)"""
    worker = tmp_path / "gradients.py"
    worker.write_text(f"import sys\nsys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
                      "from test_tensor_parallel import gradient_worker\ngradient_worker(*sys.argv[1:])\n")
    out = tmp_path / "gradients.json"
    folders = [str(dense_family_models[family]) for family in DENSE_FAMILIES]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(worker), str(out), *folders]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    for folder in folders:
        facts = results[folder]
        assert facts["max_gradient_difference"] < 1e-6, facts  # measured 6.7e-8 (fp32 sums in other orders)
        assert facts["max_replica_difference"] == 0.0, facts
    qwen3 = results[str(dense_family_models["qwen3"])]["norm_gradient_placements"]
    assert qwen3 == {"model.layers.0.self_attn.q_norm.weight": ["R"],  # Replicate, not Partial
                     "model.layers.0.self_attn.k_norm.weight": ["R"]}


def gradient_worker(out: str, *folders: str) -> None:
    """One rank of the gradient test: per model folder, the gradients after 2 micro-batches of
    the TP model (tensor_parallel.tp_plan) and of a 1-process copy; rank 0 writes the worst gaps."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    results = {}
    for folder in folders:
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")  # the same on every rank
        reference = copy.deepcopy(model)
        generator = torch.Generator().manual_seed(0)
        micro_batches = [torch.randint(0, VOCAB, (4, 32), generator=generator) for _ in range(2)]
        parallelize_module(model, mesh["tp"], tensor_parallel.tp_plan(model))
        for m in (reference, model):
            for ids in micro_batches:
                m(input_ids=ids, labels=ids).loss.backward()
        facts = {"max_gradient_difference": 0.0, "max_replica_difference": 0.0, "norm_gradient_placements": {}}
        for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
            grad = param.grad
            local = (grad.to_local() if isinstance(grad, DTensor) else grad).clone()
            whole = grad.full_tensor() if isinstance(grad, DTensor) else grad
            facts["max_gradient_difference"] = max(facts["max_gradient_difference"],
                                                   (whole - expected.grad).abs().max().item())
            if not (isinstance(grad, DTensor) and any(isinstance(p, Shard) for p in grad.placements)):
                first = local.clone()
                dist.broadcast(first, src=0)
                facts["max_replica_difference"] = max(facts["max_replica_difference"],
                                                      (local - first).abs().max().item())
            if "layers.0.self_attn" in name and "norm" in name and isinstance(grad, DTensor):
                facts["norm_gradient_placements"][name] = [str(p) for p in grad.placements]
        results[folder] = facts
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()  # no rank tears gloo down while the other is still in a collective
    dist.destroy_process_group()
    # Exit without Python's finalisation: gloo's worker thread may drop its last collective (holding a
    # Python tensor) after the main thread has started finalising, and that aborts the process (1 run in
    # about 8 here, "terminate called without an active exception"; gdb: ProcessGroupGloo::runLoop ->
    # ~AsyncWork -> take_gil -> pthread_exit). Everything this worker writes is written and closed above.
    os._exit(0)


# ---- in-process: the style mapping and the refusals, before any model is built ----

def meta(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.quick
def test_each_declared_style_is_torchs_own_parallel_style():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    expected = {  # (class, input layouts, output layouts) of torch's styles
        "colwise": (ColwiseParallel, (Replicate(),), (Shard(-1),)),
        "rowwise": (RowwiseParallel, (Shard(-1),), (Replicate(),)),
        "colwise_gather_output": (ColwiseParallel, (Replicate(),), (Replicate(),)),
        "rowwise_split_input": (RowwiseParallel, (Replicate(),), (Replicate(),)),
        "embedding_rowwise": (RowwiseParallel, (Replicate(),), (Replicate(),)),
    }
    seen = set()
    for config in (LlamaConfig(**TINY), DENSE_FAMILIES["qwen3"](), DENSE_FAMILIES["olmo2"](),
                   Phi3Config(**TINY), GPTNeoXConfig(**TINY)):
        model = meta(config)
        plan = tensor_parallel.tp_plan(model)
        assert len(plan) == len(config.base_model_tp_plan)
        for pattern, declared in config.base_model_tp_plan.items():
            style = plan[f"{model.base_model_prefix}.{pattern}"]
            assert isinstance(style, ParallelStyle), (pattern, style)
            seen.add(declared)
            if declared == "replicated_with_grad_allreduce":
                assert type(style).__name__ == "ReplicatedWithGradAllReduce" and style.input_layout == (Shard(-2),)
                continue
            cls, inputs, outputs = expected[declared]
            assert (type(style), style.input_layouts, style.output_layouts) == (cls, inputs, outputs), pattern
    assert seen == set(expected) | {"replicated_with_grad_allreduce"}


MOE_FAMILIES = {
    "Mixtral": lambda: MixtralConfig(num_local_experts=4, **TINY),
    "Qwen3Moe": lambda: Qwen3MoeConfig(num_experts=4, moe_intermediate_size=64, head_dim=16, **TINY),
    "Olmoe": lambda: OlmoeConfig(num_experts=4, **TINY),
}


@pytest.mark.quick
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_plan_this_code_cannot_apply_is_one_line(family):
    # The experts' styles transformers 5.17-5.24 declared in these families' plans (5.25 declares their
    # attention only): set here, so the refusal is tested whatever the installed version declares.
    config = MOE_FAMILIES[family]()
    config.base_model_tp_plan = {**config.base_model_tp_plan, "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                                 "layers.*.mlp.experts": "moe_tp_experts"}
    with pytest.raises(ConfigError) as refused:
        tensor_parallel.check(stand_in(), TrainConfig(), config, "train.py")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"train.py: the {family} model's tensor-parallel plan uses 'packed_colwise' "
                              "(for layers.*.mlp.experts.gate_up_proj), 'moe_tp_experts' (for layers.*.mlp.experts), "
                              "which this code does not apply"), message


@pytest.mark.quick
def test_the_dense_families_plans_are_accepted_and_a_tied_split_embedding_refused():
    for config in (DENSE_FAMILIES["qwen3"](), DENSE_FAMILIES["olmo2"](), Phi3Config(**TINY), GPTNeoXConfig(**TINY),
                   Gemma3TextConfig(head_dim=16, **TINY)):
        tensor_parallel.check(stand_in(), TrainConfig(), config, "train.py")
        tensor_parallel.check(stand_in(dp_shard=2), TrainConfig(), config, "train.py")
    tied = GPTNeoXConfig(**{**TINY, "tie_word_embeddings": True})  # its plan splits embed_in over the vocabulary
    with pytest.raises(ConfigError, match=r"^train.py: the GPTNeoX model ties its LM head to the input embedding, "
                                          r"which its tensor-parallel plan splits \(embed_in\)"):
        tensor_parallel.check(stand_in(), TrainConfig(), tied, "train.py")


def test_a_payload_in_a_tensor_parallel_checkpoint_is_refused(tp_runs, tmp_path):
    """The DCP folder of model and optimizer shards (tests/test_safe_loading.py does the other strategies)."""
    from test_safe_loading import copy_checkpoint, plant_dcp_item, plant_raw_pickle, refused

    step_dir = copy_checkpoint(tp_runs("train.py/tp.yaml").output_dir / "checkpoints" / "step_30", tmp_path / "run")
    verify(step_dir)
    marker = tmp_path / "marker"
    plant_raw_pickle(step_dir / "model_optimizer_dcp" / ".metadata", marker)
    refused(step_dir, "model_optimizer_dcp/.metadata", marker)
    step_dir = copy_checkpoint(tp_runs("train.py/tp.yaml").output_dir / "checkpoints" / "step_30", tmp_path / "run2")
    plant_dcp_item(step_dir / "model_optimizer_dcp", marker)
    refused(step_dir, "model_optimizer_dcp/__", marker)
