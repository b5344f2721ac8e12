"""Every bench/ module's smoke run, `python -m bench.X --smoke` (smallest size, one rep, the same code path as its full
run, child processes and namespaces included), as a user runs it: a subprocess from the repository root, which must
exit 0 and print its measurement. The modules are enumerated, so a bench added without a smoke mode fails here."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.support import ROOT

BENCHES = sorted(p.stem for p in (ROOT / "bench").glob("bench_*.py"))
# Benches that start vLLM engines, MLX nodes, stacks or the site: the e2e tier (under the heavy lock). Any bench not
# named in QUICK lands here too, so a new one runs somewhere until someone says it is cheap.
QUICK = {"bench_class_drafts", "bench_convert", "bench_extract", "bench_fidelity", "bench_gateway", "bench_grammar",
         "bench_kv_auth", "bench_kv_memory", "bench_learned", "bench_link", "bench_spec", "bench_spec_control",
         "bench_stall", "bench_step_cost", "bench_traffic_check", "bench_transfer", "bench_window"}
# What each prints once it has measured (its table or ratio): an early exit with status 0 cannot pass. A bench not
# named here must print a ratio ("1.23x").
PRINTS = {
    "bench_burst": r"target = split / \(vllm prefill",
    "bench_class_drafts": r"suffix_class +all +\d+",
    "bench_class_spec": r"\d\.\d+ ?x",
    "bench_fidelity_recover": r"this tree +\d+\.\d +\d+\.\d +\d+\.\d +verified",  # back up, carries KV, verified
    "bench_step_cost": r"verify_cost k=1/2/3 at 6k",
    "bench_traffic_check": r"check / prefill \d",
    "bench_concurrency": r"scaling:",
    "bench_convert": r"build_prompt_cache \(mlx\)",
    "bench_extract": r"ratio +\d",
    "bench_fidelity": r"honest verified 1/1",
    "bench_gateway": r"RPS ours/direct",
    "bench_grammar": r"json_schema .* ratio \d",
    "bench_kv_auth": r"per-frame MAC .* of open",
    "bench_kv_memory": r"25k/Mac",
    "bench_link": r"bridge, signed \(per-frame MAC\) +[\d.]+ +[\d.]+ +[\d.]+x",
    "bench_long": r"total \d+ s",
    "bench_mixed_precision": r"4-bit/\w+ +\d",
    "bench_overlap": r"exposed ms",
    "bench_prefix": r"totals: KV moved",
    "bench_queue_burst": r"max_queued 1",
    "bench_site": r"ratio vs split",
    "bench_spec": r"vs plain",
    "bench_split": r"TTFT speed-up",
    "bench_stall": r"ratio \d",
    "bench_threshold": r"break-even",
    "bench_transfer": r"as it is",
    "bench_window": r"ratio \d",
}
# Benches that measure a running deployment from its config (`--config`, bench/site_target.py), or use its prefill
# node under nodes of their own (class_spec, prefix: a decode node and gateway each; mixed_precision, overlap: the
# prefill node alone): the session stack stands in for it, which saves a vLLM start each (their own-stack path is a
# few lines over tests/support/stack.py).
ON_STACK = {"bench_burst", "bench_class_spec", "bench_concurrency", "bench_long", "bench_mixed_precision",
            "bench_overlap", "bench_prefix", "bench_queue_burst", "bench_split", "bench_threshold"}
# Benches that measure the seed site (`make site`): `--running` against conftest's seed_site (test_site_e2e's), which
# saves a site start each; marker seedsite runs them after test_site_e2e, the site still up.
ON_SITE = {"bench_fidelity_recover", "bench_site"}
NEEDS_ROOT = {"bench_link"}  # a network namespace and a shaped veth pair


def _param(name: str):
    marks = [] if name in QUICK else [pytest.mark.e2e]
    if name in ON_SITE:
        marks.append(pytest.mark.seedsite)
    return pytest.param(name, marks=marks, id=name)


def _root_reason() -> str | None:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs root and iproute2 (ip netns, tc)"
    return None


def smoke(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _shown(r: subprocess.CompletedProcess) -> str:
    return f"rc {r.returncode}\n--- stdout (tail)\n{r.stdout[-3000:]}\n--- stderr (tail)\n{r.stderr[-3000:]}"


@pytest.fixture
def measured(request) -> list[str]:
    """The arguments that point a smoke run at what it measures beside its own processes: the session stack's config
    or the seed site, started here (their start counted in the test's setup, not in its run)."""
    name = request.node.callspec.params["name"]
    if name in ON_STACK:
        return ["--config", str(request.getfixturevalue("stack").config)]
    if name in ON_SITE:
        request.getfixturevalue("seed_site")
        return ["--running"]
    return []


@pytest.mark.parametrize("name", [_param(n) for n in BENCHES])
def test_smoke(name, measured):
    if name in NEEDS_ROOT and _root_reason():
        pytest.skip(_root_reason())
    r = smoke(["-m", f"bench.{name}", "--smoke", *measured], timeout=120 if name in QUICK else 900)
    assert r.returncode == 0, _shown(r)
    assert re.search(PRINTS.get(name, r"\d\.\d+ ?x"), r.stdout), _shown(r)
    print(r.stdout[-1500:])  # its measurement, for `pytest -rP` (the figures are the bench's, not the test's)


def test_every_bench_has_a_smoke_mode():
    """Cheap, in the quick tier: a bench added without --smoke is named here before the e2e tier runs it."""
    missing = [n for n in BENCHES if '"--smoke"' not in (ROOT / "bench" / f"{n}.py").read_text()]
    assert not missing, f"bench modules without a --smoke mode (tests/bench/test_smoke.py): {missing}"


def test_no_bench_starts_a_child_by_its_script_path():
    """A child run as `python bench/x.py` cannot import its siblings in the bench package (issue 52): children are
    started with -m from the repository root."""
    argv = re.compile(r"sys\.executable,[^\]\n]*\b__file__")  # [sys.executable, __file__, ...], "-I" before it too
    bad = [n for n in BENCHES if argv.search((ROOT / "bench" / f"{n}.py").read_text())]
    assert not bad, f"started by script path, not -m: {bad}"


@pytest.mark.skipif(_root_reason() is not None, reason=_root_reason() or "")
def test_a_child_that_cannot_import_fails_the_smoke_run():
    """bench_link's namespace child started as it was before issue 52 (a script path, no PYTHONPATH: `-I`, as a new
    user's shell): the child dies on `No module named 'bench'`, and the bench says so and exits non-zero at once."""
    code = ("import sys; from bench import bench_link as b; "
            "b.child_argv = lambda n, host: [sys.executable, '-I', b.__file__, '--child', str(n), host]; "
            "sys.argv = ['bench_link', '--smoke']; b.main()")
    r = smoke(["-c", code], timeout=60)
    assert r.returncode != 0, _shown(r)
    assert "No module named 'bench'" in r.stderr and "the prefill end died" in r.stderr, _shown(r)
    assert "bridge, open" not in r.stdout  # nothing measured


@pytest.mark.cuda
def test_extract_smoke_times_the_cuda_path():
    """bench_extract's CUDA rows (pinned buffer, side stream): only where torch sees a GPU; elsewhere skipped, and the
    quick run above prints that the CUDA path was not timed."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    r = smoke(["-m", "bench.bench_extract", "--smoke"], timeout=300)
    assert r.returncode == 0 and re.search(r" cuda +\d+ calls", r.stdout), _shown(r)


def test_make_bench_docs_runs_every_bench_docs_quote():
    """`make bench-docs` (Makefile's BENCH_DOCS_RUNS) re-runs each bench whose figures docs/ quotes, so they can be
    refreshed in one go; those docs/ name only as a command against a running site are left out."""
    make = (ROOT / "Makefile").read_text()
    runs = make[make.index("define BENCH_DOCS_RUNS"):make.index("endef", make.index("define BENCH_DOCS_RUNS"))]
    in_make = set(re.findall(r"^(bench_\w+)", runs, re.M))
    site_only = {"bench_queue_burst"}  # a burst against `make site`: docs/site.md gives the command, no figure
    named = set()
    for doc in (ROOT / "docs").glob("*.md"):
        if doc.name != "deploy.md":  # deploy.md: commands to measure the lab's own site (--config), no figures
            named |= set(re.findall(r"bench[./](bench_\w+?)(?:\.py)?\b", doc.read_text()))
    missing = sorted((named & set(BENCHES)) - in_make - site_only)  # (testing.md names a generic bench_x)
    assert not missing, f"docs/ quotes these benches but `make bench-docs` does not run them (Makefile): {missing}"
    assert in_make <= set(BENCHES), f"BENCH_DOCS_RUNS names no such bench: {sorted(in_make - set(BENCHES))}"
