"""The `disagg` command: bad configuration exits 2 with a message naming the field and no traceback, before
any role module (torch, vllm, mlx) is imported."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.cli import assert_config_error, run, write
from tests.support import ROOT

GOOD = """
[gateway]
port = 8000

[[nodes]]
name = "prefill-0"
role = "prefill"
port = 8100

[[nodes]]
name = "decode-0"
role = "decode"
port = 8200
kv_port = 8201

[[models]]
id = "smollm2:135m"
path = "models/smollm2-135m"
prefill = ["prefill-0"]
decode = ["decode-0"]
"""


def test_decode_node_without_kv_port(tmp_path):
    bad = write(tmp_path, GOOD.replace("kv_port = 8201\n", ""))
    assert_config_error(run("gateway", "--config", str(bad), cwd=tmp_path), "kv_port", "decode-0")


def test_model_naming_an_unknown_node(tmp_path):
    bad = write(tmp_path, GOOD.replace('decode = ["decode-0"]', 'decode = ["decode-9"]'))
    assert_config_error(run("gateway", "--config", str(bad), cwd=tmp_path), "decode-9", "[[nodes]]")


def test_out_of_range_port_names_the_field(tmp_path):
    bad = write(tmp_path, GOOD.replace("port = 8000", "port = 80000"))
    assert_config_error(run("gateway", "--config", str(bad), cwd=tmp_path), "gateway.port", "80000")


def test_toml_syntax_error(tmp_path):
    bad = write(tmp_path, GOOD + "\n[gateway\n")
    assert_config_error(run("gateway", "--config", str(bad), cwd=tmp_path), "syntax")


def test_missing_config_file_says_how_to_pass_one(tmp_path):
    assert_config_error(run("gateway", cwd=tmp_path), "config.toml", "--config")


def test_config_from_environment(tmp_path):
    bad = write(tmp_path, GOOD.replace("kv_port = 8201\n", ""))
    r = run("gateway", cwd=tmp_path, env={"DISAGG_CONFIG": str(bad)})
    assert_config_error(r, "kv_port")


def test_unknown_node_lists_the_known_ones(tmp_path):
    good = write(tmp_path, GOOD, "config.toml")
    assert_config_error(run("decode", "--node", "decode-7", "--config", str(good), cwd=tmp_path),
                        "decode-7", "decode-0")


def test_node_of_the_wrong_role(tmp_path):
    good = write(tmp_path, GOOD, "config.toml")
    assert_config_error(run("prefill", "--node", "decode-0", cwd=tmp_path), "role 'decode'", "disagg decode")


def test_prepare_unknown_model_id(tmp_path):
    good = write(tmp_path, GOOD, "config.toml")
    assert_config_error(run("models", "prepare", "--model", "nope:1", "--config", str(good), cwd=tmp_path),
                        "nope:1", "smollm2:135m")


def test_prepare_a_non_embedded_model_without_files(tmp_path):
    text = GOOD.replace('id = "smollm2:135m"', 'id = "other:1"').replace("models/smollm2-135m", "models/other")
    write(tmp_path, text, "config.toml")
    r = run("models", "prepare", cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert "other:1" in r.stderr and "config.json" in r.stderr


def test_help_lists_every_command(tmp_path):
    r = run("--help", cwd=tmp_path)
    assert r.returncode == 0
    for cmd in ("models", "prefill", "decode", "gateway", "up"):
        assert cmd in r.stdout


@pytest.mark.parametrize("module", ["backends.cli.main", "backends.cli.up", "backends.cli.models"])
def test_no_heavy_imports(module):
    """`disagg gateway` must run where torch, vllm and mlx are not installed."""
    code = (f"import sys, {module}; heavy = [m for m in ('torch', 'vllm', 'mlx', 'transformers') "
            "if m in sys.modules]; print(heavy); sys.exit(1 if heavy else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
