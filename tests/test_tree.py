"""tests/ mirrors the code (docs/testing.md, "Where a module's tests are"): every test file sits in the folder of a
package it tests (or one of the documented exceptions), what tests share is the package tests.support, no test module
imports another, and neither tests/ nor bench/ edits sys.path."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import ROOT

TESTS = ROOT / "tests"
# Folders under tests/ that mirror no package: the seed site as `make site` runs it, docker/ and docs/deploy.md.
EXCEPTIONS = {"site", "deploy"}
SOURCES = sorted(p for d in (TESTS, ROOT / "bench") for p in d.rglob("*.py") if "__pycache__" not in p.parts)


def _imported(tree: ast.AST) -> set[str]:
    """Every module `tree` imports (dotted, relative imports as written), at any depth."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            out.add(base)
            out.update(f"{base}.{a.name}" if node.module else base + a.name for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def imported_test_modules(source: str) -> set[str]:
    """The suite's test modules (`test_*`, top-level, relative or under tests.) a source imports."""
    return {m for m in _imported(ast.parse(source)) if m.rsplit(".", 1)[-1].startswith("test_")
            and ("." not in m or m.startswith(("tests.", ".")))}


def sys_path_uses(source: str) -> int:
    """How often a source touches `sys.path` (to insert, append or assign)."""
    return sum(isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name)
               and n.value.id == "sys" for n in ast.walk(ast.parse(source)))


def test_the_checks_see_what_they_look_for():
    source = "from test_cli import run\nimport tests.gateway.test_e2e\nfrom tests.support import e2e"
    assert imported_test_modules(source) == {"test_cli", "tests.gateway.test_e2e"}
    assert imported_test_modules("def f():\n    from tests.backends import test_cli\n") == {"tests.backends.test_cli"}
    assert imported_test_modules("from aiohttp.test_utils import TestServer\nfrom . import test_x") == {".test_x"}
    assert sys_path_uses("import sys\nsys.path.insert(0, 'x')\n") == 1
    assert sys_path_uses("import os\nos.path.join('a')\n") == 0


def test_no_module_imports_a_test_module():
    found = {str(p.relative_to(ROOT)): sorted(imported_test_modules(p.read_text())) for p in SOURCES}
    assert {p: m for p, m in found.items() if m} == {}


def test_no_sys_path_edits_in_tests_or_bench():
    found = {str(p.relative_to(ROOT)): sys_path_uses(p.read_text()) for p in SOURCES}
    assert {p: n for p, n in found.items() if n} == {}


def test_support_imports_only_support_from_tests():
    for path in sorted((TESTS / "support").rglob("*.py")):
        outside = {m for m in _imported(ast.parse(path.read_text()))
                   if m.split(".")[0] == "tests" and not m.startswith("tests.support")}
        assert not outside, f"{path.relative_to(ROOT)} imports {sorted(outside)}"


def test_every_test_file_sits_in_a_folder_that_mirrors_a_package():
    for path in sorted(TESTS.rglob("test_*.py")):
        folder = path.parent.relative_to(TESTS)
        if folder.parts[:1] == ("support",):
            raise AssertionError(f"{path.relative_to(ROOT)}: tests.support holds no tests")
        if folder == Path("."):
            assert path.name == "test_tree.py", f"{path.relative_to(ROOT)}: move it to its package's folder"
        elif folder.parts[0] not in EXCEPTIONS:
            assert (ROOT / folder / "__init__.py").is_file(), \
                f"{path.relative_to(ROOT)}: {folder.as_posix()}/ is no package of the repository"


def test_every_folder_is_a_package_and_holds_only_tests():
    for folder in sorted(p for p in [TESTS, *TESTS.rglob("*")] if p.is_dir() and "__pycache__" not in p.parts):
        if folder.relative_to(TESTS).parts[:1] == ("support",):
            continue
        assert (folder / "__init__.py").is_file(), f"{folder.relative_to(ROOT)} has no __init__.py"
        others = [p.name for p in folder.glob("*.py") if not p.name.startswith("test_")]
        assert set(others) <= {"__init__.py", "conftest.py"}, \
            f"{folder.relative_to(ROOT)}: {others}: shared code goes in tests/support"


CODE = [ROOT / p for p in ("gateway", "backends", "kv_bridge")]  # the three packages


def prefix_families(names: list[str], at_least: int = 3) -> dict[str, list[str]]:
    """Module names of one folder that share a prefix before `_` (`decode_node`, `decode_engine`, ...): a folder
    asking to exist."""
    groups: dict[str, list[str]] = {}
    for n in names:
        if "_" in n.strip("_"):
            groups.setdefault(n.split("_")[0], []).append(n)
    return {p: sorted(ns) for p, ns in groups.items() if len(ns) >= at_least}


def test_prefix_families_are_seen():
    assert prefix_families(["decode_node", "decode_engine", "decode_batch", "sampling"]) == \
        {"decode": ["decode_batch", "decode_engine", "decode_node"]}
    assert prefix_families(["node", "engine", "batch", "prefix_cache", "mac_memory"]) == {}


def test_no_folder_of_the_code_holds_a_family_of_name_prefixes():
    for top in CODE:
        for folder in [top, *(p for p in top.rglob("*") if p.is_dir() and "__pycache__" not in p.parts)]:
            names = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
            assert prefix_families(names) == {}, f"{folder.relative_to(ROOT)}: make a package of {prefix_families(names)}"


def test_every_package_of_backends_and_the_config_says_what_it_is_and_may_import():
    inits = [*sorted((ROOT / "backends").rglob("__init__.py")), ROOT / "kv_bridge" / "config" / "__init__.py"]
    for init in inits:
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "import" in doc.lower(), f"{init.relative_to(ROOT)}: its docstring says what the package is and what it may import"


def makefile_marker_expressions(target: str) -> list[str]:
    """The `-m` expression of each pytest run in the Makefile's `target` recipe, in order."""
    import re

    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"{target}:"))
    recipe = []
    for ln in lines[start + 1:]:
        if not ln.startswith("\t"):
            break
        recipe.append(ln)
    return [m.group(1) for ln in recipe if "pytest" in ln for m in [re.search(r'-m "([^"]+)"', ln)] if m]


def test_make_tests_two_runs_select_exact_complements():
    """`make test`'s quick and engine tiers (Makefile): for every combination of the markers that decide the tier,
    exactly one of the two runs selects a test, so each test runs once and none is left out; `make test-quick` is the
    first of them."""
    import itertools

    runs = makefile_marker_expressions("test")
    assert len(runs) == 2, runs
    assert makefile_marker_expressions("test-quick") == runs[:1]
    markers = ("e2e", "soak", "cuda", "seedsite")
    for values in itertools.product((False, True), repeat=len(markers)):
        marks = dict(zip(markers, values))
        chosen = [eval(expr, {"__builtins__": {}}, marks) for expr in runs]  # names: markers; and/or/not: Python's
        assert sum(chosen) == 1, (marks, runs, chosen)
