"""Diff discipline: a feature recipe is bf16_baseline.py plus marked hunks, nothing else.

A hunk opens with a line `# New: <why>` and closes with `# End new`. Outside the module
docstring (each recipe explains its own technique), every line the recipe adds, changes or
removes relative to the baseline must lie inside a hunk; every hunk must contain a real change.
"""

import ast
import difflib

import pytest

from conftest import ROOT


pytestmark = pytest.mark.quick  # launches nothing: docs/testing.md#running-the-tests

FEATURE_RECIPES = ["ddp.py", "fsdp_full_shard.py", "deepspeed_zero3_offload.py", "fp16_scaler.py", "tensor_parallel.py",
                   "pipeline_parallel.py",
                   "accumulate_and_clip.py", "lora.py"]


def code_lines(path):
    """Source lines after the module docstring."""
    text = path.read_text()
    docstring = ast.parse(text).body[0]
    assert isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant), f"{path.name}: no docstring"
    return text.splitlines()[docstring.end_lineno:]


def marked_hunks(lines, name):
    hunks, start = [], None
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("# New:"):
            assert start is None, f"{name}:{i}: hunk opened inside another"
            assert len(stripped) > len("# New:") + 3, f"{name}:{i}: a hunk's marker says why"
            start = i
        elif stripped == "# End new":
            assert start is not None, f"{name}:{i}: '# End new' without '# New:'"
            hunks.append((start, i))
            start = None
    assert start is None, f"{name}: hunk opened at line {start} never closed"
    return hunks


def unmarked_changes(baseline, recipe, hunks):
    inside = lambda j: any(a <= j <= b for a, b in hunks)  # noqa: E731
    strays, used = [], set()
    matcher = difflib.SequenceMatcher(None, baseline, recipe, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        # a deletion happens between recipe lines j1-1 and j1: that gap must be inside a hunk
        positions = range(j1, j2) if j2 > j1 else [j1 - 1, j1]
        for j in positions:
            if not inside(j):
                strays.append((tag, baseline[i1:i2], recipe[j1:j2]))
                break
        used.update(k for k, (a, b) in enumerate(hunks) if any(a <= j <= b for j in positions))
    return strays, [hunks[k] for k in range(len(hunks)) if k not in used]


@pytest.mark.parametrize("name", FEATURE_RECIPES)
def test_feature_recipe_differs_from_baseline_only_in_marked_hunks(name):
    baseline = code_lines(ROOT / "recipes" / "bf16_baseline.py")
    recipe = code_lines(ROOT / "recipes" / name)
    hunks = marked_hunks(recipe, name)
    assert hunks, f"{name} has no marked delta"
    strays, empty = unmarked_changes(baseline, recipe, hunks)
    assert not strays, f"{name} changes the baseline outside '# New:' hunks: {strays}"
    assert not empty, f"{name} has hunks with no change in them (lines {empty})"


def test_checker_catches_an_unmarked_change():
    baseline = ["a = 1", "b = 2", "c = 3"]
    assert unmarked_changes(baseline, ["a = 1", "b = 5", "c = 3"], [])[0]
    assert unmarked_changes(baseline, ["a = 1", "c = 3"], [])[0]  # a silent deletion
    marked = ["a = 1", "# New: why", "b = 5", "# End new", "c = 3"]
    assert unmarked_changes(baseline, marked, marked_hunks(marked, "x")) == ([], [])
