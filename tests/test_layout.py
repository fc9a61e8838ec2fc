"""The repository's shape, in-process: the core a user copies with a recipe, the options each recipe
takes, the README as an index. (The copied recipe really runs: test_distributed.py's copy test.)"""

import ast
import dataclasses
import re

import pytest

from common.config import ConfigError, parse
from conftest import ROOT, SYNTHETIC, load_recipe
from train_extras.options import TrainConfig


pytestmark = pytest.mark.quick  # launches nothing: docs/testing.md#running-the-tests

CORE = ROOT / "common"
# 900 until issue 29 (1,064 after it): local data as users have it (folders, globs, csv, parquet),
# an error every rank hits printed once, the export swapped in whole (common/files.py). Kept a budget:
# what only train.py needs goes to train_extras/. 1,125 since issue 42: every load in the core passes
# --trust_remote_code (a folder's own code is one line naming the option, never a prompt), and a text
# column that holds no text is one line. 1,156 (issue 42): every recipe's export goes in with its
# marker and replaces only an export so marked (a user's `model/` package was deleted), and a killed
# export's leftovers are removed without following a link: the check belongs where the folder is replaced.
# 1,158 (issue 43): a bf16/fp16 export keeps in fp32 what the family keeps there (DeepSeek-V3's router).
# 1,171 (issue 44): unwrapping outside DeepSpeed without importing deepspeed (its "Setting accelerator
# to CPU" warning was in every plain run's log on a machine without a GPU).
# 1,176 (issue 45): export_pretrained's `write`, through which a LoRA run writes its adapter folder.
# 1,182 (issue 45): --warmup_ratio in the core, the default warmup (every recipe's), a share of the run.
# 1,248 (issue 49): --gradient_checkpointing true|selective|false and the selective checkpoint's
# dispatch modes (every recipe builds its model through common/model.build_model, so every recipe has it).
# 1,257 (issue 49): selective recomputes a LoRA adapter's up-projection (kept, it held more than none).
CORE_LINE_BUDGET = 1257
RECIPES = sorted(p.name for p in (ROOT / "recipes").glob("*.py") if p.name not in ("train.py", "generate.py"))


def imports_of(path) -> set[str]:
    """Top-level names of every module a file imports (`from common import x` gives common.x)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_core_fits_the_budget_and_imports_nothing_above_itself():
    files = sorted(CORE.glob("*.py"))
    lines = sum(len(f.read_text().splitlines()) for f in files)
    assert lines <= CORE_LINE_BUDGET, f"common/ is {lines} lines"
    modules = {f"common.{f.stem}" for f in files if f.stem != "__init__"}
    graph = {}
    for f in files:
        imported = imports_of(f)
        assert not {n for n in imported if n.split(".")[0] in ("train_extras", "tools", "tests", "recipes")}, f
        graph[f"common.{f.stem}"] = {n for n in imported if n in modules}

    def visit(module, path):  # depth-first: a module met again on its own path is a cycle
        assert module not in path, f"import cycle: {' -> '.join(path + [module])}"
        for child in graph.get(module, ()):
            visit(child, path + [module])

    for module in graph:
        visit(module, [])


def test_the_baseline_needs_only_the_core():
    packages = {name.split(".")[0] for name in imports_of(ROOT / "recipes" / "bf16_baseline.py")}
    assert packages & {"train_extras", "tools"} == set() and "common" in packages


def attributes_read(paths) -> set[str]:
    return {node.attr for path in paths for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute)}


# A valid value for every option of train.py whose default does not make a command-line value.
SAMPLE_VALUES = {"config": None, "data_files": SYNTHETIC, "report_to": "tensorboard", "resume_from_checkpoint": "auto",
                 "eval_fraction": "0.5", "model_name_or_path": "some/model", "tokenizer_name_or_path": "some/tokenizer",
                 "dataset_name": "some/dataset", "dataset_config": "default", "run_name": "a-run",
                 "eval_split": "validation", "eval_data_files": SYNTHETIC, "warmup_steps": "3",
                 "dataset_num_proc": "2", "lora_r": "8", "lora_alpha": "16", "lora_target_modules": "q_proj"}
# Options that only mean something beside another one, which the recipe then gets too.
COMPANIONS = {"eval_split": ["--dataset_name", "some/dataset"], "eval_data_files": ["--data_files", SYNTHETIC]}


def option_argv(option: dataclasses.Field, tmp_path) -> list[str]:
    if option.name == "config":
        (tmp_path / "seed.yaml").write_text("seed: 1234\n")  # one option: an empty config file is refused
        return ["--config", str(tmp_path / "seed.yaml")]
    value = SAMPLE_VALUES.get(option.name, option.default)
    if isinstance(value, bool):
        value = "true" if value else "false"
    return COMPANIONS.get(option.name, []) + [f"--{option.name}", str(value)]


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_option_of_train_py_is_used_by_the_recipe_or_refused_with_its_name(recipe, tmp_path):
    """Never silence: an option a recipe accepts is one its code (or the core's) reads; any other is
    an unknown-option error that names the recipe."""
    module = load_recipe(recipe[:-3])
    read = attributes_read([ROOT / "recipes" / recipe, *CORE.glob("*.py")])
    accepted, refused = [], []
    for option in dataclasses.fields(TrainConfig):
        argv = option_argv(option, tmp_path)
        try:
            cfg = parse(module.Options, argv, recipe=recipe)
        except ConfigError as err:
            assert f"unknown option(s) for {recipe}: --{option.name}" in str(err), (option.name, str(err))
            refused.append(option.name)
            continue
        assert option.name == "config" or option.name in read, f"{recipe} accepts --{option.name} but never reads it"
        assert getattr(cfg, option.name) is not None or option.name == "config"
        accepted.append(option.name)
    help_text = "\n".join(f.name for f in dataclasses.fields(module.Options))
    assert set(accepted) == {f.name for f in dataclasses.fields(module.Options)}, help_text
    assert {"save_every", "resume_from_checkpoint", "report_to", "sample_length"} <= set(refused)


def test_help_lists_only_the_recipes_options(capsys):
    module = load_recipe("bf16_baseline")
    with pytest.raises(SystemExit):
        parse(module.Options, ["--help"], recipe="bf16_baseline.py")
    out = capsys.readouterr().out
    assert "--lr" in out and "--seq_len" in out
    assert "--save_every" not in out and "--gradient_accumulation_steps" not in out and "--report_to" not in out


def test_readme_is_an_index_of_docs():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 15_000
    commands = re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S)
    assert "accelerate launch recipes/train.py" in commands[0] and "pytest tests" in commands[0] + commands[1]
    for doc in text.split("](")[1:]:
        target = doc.split(")")[0].split("#")[0]
        if target and not target.startswith("http"):
            assert (ROOT / target).exists(), target
    assert len(re.findall(r"\]\(docs/\w+\.md", text)) >= 6


def test_no_file_cites_something_outside_the_repository():
    text_files = [p for p in ROOT.rglob("*") if p.is_file() and p.suffix in (".py", ".md", ".yaml", ".sh", ".toml", "")
                  and ".git" not in p.parts and "results" not in p.parts and "egg-info" not in str(p)]
    for path in text_files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for outside in ("FACTS" + ".md", "../" + "shared/"):  # (spelled apart: this file must not match itself)
            assert outside not in text, (path, outside)


def function_lengths(path) -> dict[str, int]:
    """Lines of every function and method in a file, by qualified name."""
    lengths = {}

    def walk(node, prefix=""):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lengths[name] = child.end_lineno - child.lineno + 1
                walk(child, f"{name}.")

    walk(ast.parse(path.read_text()))
    return lengths


def test_the_recipes_read_as_short_named_steps():
    """train.py's main is its data flow in named steps (<= 80 lines), no recipe function passes
    120 lines, and train.py's lines are mostly under 100 characters (the documented launch lines
    of its docstring, run as written by test_documented_commands.py, may be longer)."""
    train = ROOT / "recipes" / "train.py"
    assert function_lengths(train)["main"] <= 80
    for recipe in sorted((ROOT / "recipes").glob("*.py")):
        long = {name: n for name, n in function_lengths(recipe).items() if n > 120}
        assert not long, (recipe.name, long)
    lines = train.read_text().splitlines()
    assert sum(len(line) > 100 for line in lines) <= 0.02 * len(lines)


def test_train_extras_has_no_import_cycles():
    """train_extras/ by capability (resume/, observe/, parallel/): its modules import one another
    at module level without a cycle, and nothing from recipes/, tools/ or tests/."""
    root = ROOT / "train_extras"
    files = {".".join(("train_extras", *p.relative_to(root).with_suffix("").parts)): p for p in root.rglob("*.py")}
    modules = {name.removesuffix(".__init__") for name in files}
    graph = {}
    for name, path in files.items():
        imported = set()
        for node in ast.parse(path.read_text()).body:  # module level only: a function's import runs later
            if isinstance(node, ast.ImportFrom) and node.module:
                imported |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
        assert not {n for n in imported if n.split(".")[0] in ("recipes", "tools", "tests")}, path
        graph[name.removesuffix(".__init__")] = {n for n in imported if n in modules} - {name}

    def visit(module, path):
        assert module not in path, f"import cycle: {' -> '.join(path + [module])}"
        for child in graph.get(module, ()):
            visit(child, path + [module])

    for module in graph:
        visit(module, [])
    assert {"train_extras.resume.checkpoint", "train_extras.observe.run_record",
            "train_extras.parallel.fsdp_settings", "train_extras.parallel.deepspeed_settings"} <= modules


DATA_FLOW = ("sources", "formats", "render", "packing", "assemble", "at_scale")


def test_the_data_room_takes_only_from_the_files_before_it():
    """train_extras/data/ (docs/data.md): each file imports the room's files before it in the data
    flow, at its top (no import inside a function, where a circle would hide), and none after it."""
    room = ROOT / "train_extras" / "data"
    assert sorted(p.stem for p in room.glob("*.py")) == sorted(("__init__", *DATA_FLOW))
    for i, name in enumerate(DATA_FLOW):
        tree = ast.parse((room / f"{name}.py").read_text())
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("train_extras"):
                assert id(node) in top, f"{name}.py imports {node.module} inside a function"
                module = node.module.split(".")
                taken = ({a.name for a in node.names} if node.module == "train_extras.data" else
                         set(module[2:3]) if module[:2] == ["train_extras", "data"] else set())
                assert taken <= set(DATA_FLOW[:i]), f"{name}.py takes {sorted(taken)} (after it in the flow)"
