"""The mutation check's own logic (scripts/mutation/run.py), in-process and fast: planting a snippet and
putting the file back, stale snippets, the outcome of each pytest exit code, the baseline's failures,
the scratch copy's file list; and the list itself (scripts/mutation/mutants.py) against today's code:
each `old` snippet occurs exactly once in its file and each test it names exists, so the list cannot
rot silently. The mutants themselves run on demand only (python -m scripts.mutation; docs/testing.md)."""

from __future__ import annotations

import re
import sys

import pytest

from conftest import ROOT

if str(ROOT) not in sys.path:  # plain `pytest` (not python -m) has the tests folder on sys.path, not the root
    sys.path.insert(0, str(ROOT))

from scripts.mutation import run as tool  # noqa: E402
from scripts.mutation.mutants import MUTANTS, Mutant  # noqa: E402


pytestmark = pytest.mark.quick  # launches nothing: docs/testing.md#running-the-tests

PRODUCT = ("recipes/", "common/", "train_extras/", "tools/plan/")


def test_apply_replaces_the_one_occurrence():
    assert tool.apply("a = 1\nb = a + 1\n", "a + 1", "a - 1") == "a = 1\nb = a - 1\n"
    assert tool.apply("x\n    y\n", "x\n    y", "z") == "z\n"  # several lines, indentation exact


@pytest.mark.parametrize("text, count", [("nothing here", 0), ("a + 1; a + 1", 2)])
def test_a_snippet_not_found_exactly_once_is_stale(text, count):
    with pytest.raises(tool.Stale) as err:
        tool.apply(text, "a + 1", "a - 1")
    assert err.value.count == count


def test_a_planted_mutant_is_put_back_byte_for_byte(tmp_path):
    source = tmp_path / "common" / "thing.py"
    source.parent.mkdir()
    original = b"def f(x):\n    return x + 1  # caf\xc3\xa9\n"
    source.write_bytes(original)
    mtime = source.stat().st_mtime_ns
    mutant = Mutant(id="m", file="common/thing.py", old="x + 1", new="x - 1", what="off by two", tests=())
    planted = tool.Planted(tmp_path, mutant)
    assert source.read_text() == "def f(x):\n    return x - 1  # café\n"
    planted.restore()
    assert source.read_bytes() == original and source.stat().st_mtime_ns == mtime
    stale = Mutant(id="s", file="common/thing.py", old="x * 1", new="x", what="", tests=())
    with pytest.raises(tool.Stale):
        tool.Planted(tmp_path, stale)
    assert source.read_bytes() == original  # a stale mutant leaves the file alone


@pytest.mark.parametrize("code, timed_out, outcome", [
    (0, False, "SURVIVED"), (1, False, "caught"), (2, False, "ERROR"), (3, False, "ERROR"), (4, False, "ERROR"),
    (5, False, "ERROR"), (-9, True, "TIMEOUT"), (None, True, "TIMEOUT"), (-15, False, "ERROR"),
])
def test_the_outcome_of_each_pytest_exit(code, timed_out, outcome):
    assert tool.classify(code, timed_out) == outcome


def test_the_score_counts_only_caught_mutants():
    result = tool.score(["caught", "SURVIVED", "caught", "ERROR", "TIMEOUT", "STALE"])
    assert (result["caught"], result["total"], result["caught_of_judged"]) == (2, 6, "2/3")
    assert result["counts"]["TIMEOUT"] == 1 and result["counts"]["MISSING"] == 0


def test_the_baselines_failures_are_matched_to_the_mutants_tests():
    summary = ("=========================== short test summary info ============================\n"
               "FAILED tests/test_a.py::test_x[1 process, 2 x 4] - AssertionError: 0.3 != 0.2\n"
               "ERROR tests/test_b.py - ImportError: cannot import name 'y'\n"
               "SKIPPED [1] tests/test_c.py:3: no GPU\n"
               "1 failed, 1 error in 3.20s\n")
    failed = tool.failed_nodes(summary)
    assert failed == ["tests/test_a.py::test_x[1 process, 2 x 4]", "tests/test_b.py"]
    assert tool.judged_by("tests/test_a.py", failed[0]) and tool.judged_by("tests/test_a.py::test_x", failed[0])
    assert tool.judged_by("tests/test_a.py::test_x[1 process, 2 x 4]", failed[0])
    assert not tool.judged_by("tests/test_a.py::test_x_other", failed[0])
    assert not tool.judged_by("tests/test_a.py::test_x[DDP, 1 x 4 x 2 ranks]", failed[0])


def test_the_scratch_copy_leaves_out_git_venvs_outputs_and_caches(tmp_path):
    for name in ("common/a.py", "tests/test_a.py", "untracked.txt", ".git/config", "venv_here/pyvenv.cfg",
                 "venv_here/lib/x.py", ".venv/y.py", "common/__pycache__/a.cpython-311.pyc", "outputs/run/x.json",
                 "accelerate_recipes.egg-info/PKG-INFO", ".pytest_cache/v", "build/lib/z.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    assert tool.source_files(tmp_path, use_git=False) == ["common/a.py", "tests/test_a.py", "untracked.txt"]
    dest = tmp_path / "copy"
    assert tool.make_scratch(tmp_path, dest, use_git=False) == 3
    assert (dest / "common" / "a.py").read_text() == "x"


def test_pytest_runs_from_the_scratch_root_with_the_checkouts_code_first(tmp_path):
    args = tool.pytest_args(["tests/test_a.py::test_x"], tmp_path / "pytest-tmp")
    assert args[:7] == [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
    assert args[-1] == "tests/test_a.py::test_x" and args[args.index("--basetemp") + 1] == str(tmp_path / "pytest-tmp")
    assert "-x" not in tool.pytest_args(["tests/test_a.py"], tmp_path, stop_at_first=False)
    env = tool.child_env(tmp_path)
    assert "PYTHONPATH" not in env and env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert env["HF_HOME"] == str(tmp_path / "hf_home")


# ---- the list of mutants against today's code ----

def test_the_mutants_are_at_least_thirty_with_distinct_ids_in_the_product_code():
    assert len(MUTANTS) >= 30
    ids = [m.id for m in MUTANTS]
    assert len(set(ids)) == len(ids), [i for i in ids if ids.count(i) > 1]
    assert all(re.fullmatch(r"[a-z0-9-]+", i) for i in ids), ids
    for m in MUTANTS:
        assert m.file.startswith(PRODUCT), m.id
        assert m.old != m.new and m.what and m.tests, m.id


def test_each_snippet_occurs_exactly_once_in_todays_code():
    counts = {m.id: (ROOT / m.file).read_text().count(m.old) for m in MUTANTS}
    stale = {i: n for i, n in counts.items() if n != 1}
    assert not stale, f"{stale}: these mutants' old snippets do not occur exactly once (id: count) in their files " \
                      "any more; fix scripts/mutation/mutants.py"


def test_each_mutant_is_still_python():
    """A bug the tests must catch, not a SyntaxError that stops their collection (an ERROR outcome)."""
    for m in MUTANTS:
        compile(tool.apply((ROOT / m.file).read_text(), m.old, m.new), m.file, "exec")


def test_each_test_a_mutant_names_exists():
    """Its file, and the test function a node id names (the parameters are checked by --collect)."""
    wrong = []
    for m in MUTANTS:
        for spec in m.tests:
            path = ROOT / tool.spec_file(spec)
            name = spec.split("::", 1)[1].split("[", 1)[0] if "::" in spec else None
            if not (path.is_file() and path.name.startswith("test_")) or (
                    name and not re.search(rf"^def {re.escape(name)}\(", path.read_text(), re.M)):
                wrong.append(f"{m.id}: {spec}")
    assert not wrong, wrong
