"""`disagg models prepare --role ...` with real checkpoints: the embedded model's HF folder stands in for the site's;
mlx-lm's own converter makes the decode side, and the fingerprint check refuses a geometry mismatch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import tiny_models
from tests.support.cli import run, write
from tests.support.cli import twin
from tests.support import ROOT

MODEL_DIR = ROOT / "models" / "smollm2-135m"


def config(tmp_path: Path) -> Path:
    return write(tmp_path, f"""
[[nodes]]
name = "p"
role = "prefill"
port = 8100

[[nodes]]
name = "d"
role = "decode"
port = 8200
kv_port = 8201

[[models]]
id = "m"
path = "{tmp_path / 'served'}"
prefill = ["p"]
decode = ["d"]
""", "config.toml")


@pytest.fixture(autouse=True)
def _model():
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip("embedded model not prepared (make models)")


def test_decode_side_converted_by_mlx_lm(tmp_path):
    """A tiny random llama stands in for the HF folder: the conversion is mlx-lm's own, whatever the weights."""
    hf = tiny_models.build("llama", tmp_path / "hf")
    r = run("models", "prepare", "--config", str(config(tmp_path)), "--model", "m", "--role", "decode",
            "--hf", str(hf), "--bits", "8", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fingerprints agree" in r.stdout and "mlx 8-bit (group 64)" in r.stdout and "float32" in r.stdout
    assert json.loads((tmp_path / "served" / "config.json").read_text())["quantization"]["bits"] == 8
    assert "prepare m (decode)" in r.stderr  # tqdm progress


def test_prefill_side_links_the_hf_folder(tmp_path):
    r = run("models", "prepare", "--config", str(config(tmp_path)), "--model", "m", "--role", "prefill",
            "--hf", str(MODEL_DIR), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "served").resolve() == MODEL_DIR.resolve() and "float32" in r.stdout


def test_mismatched_sides_are_refused(tmp_path):
    other = twin(tmp_path, "other", config=lambda c: {**c, "num_key_value_heads": 1,
                                                         "quantization": {"group_size": 64, "bits": 4}})
    r = run("models", "prepare", "--config", str(config(tmp_path)), "--model", "m", "--role", "decode",
            "--mlx", str(other), "--against", str(MODEL_DIR), cwd=tmp_path)
    assert r.returncode == 1 and "fingerprints differ" in r.stderr, r.stdout + r.stderr
    assert "mlx 4-bit (group 64)" in r.stderr  # both sides are listed with their quantization


def test_source_that_is_neither_folder_nor_hub_id(tmp_path):
    r = run("models", "prepare", "--config", str(config(tmp_path)), "--model", "m", "--role", "prefill",
            "--hf", "/no/such/folder", cwd=tmp_path)
    assert r.returncode == 1 and "neither a folder here nor a hub id" in r.stderr, r.stdout + r.stderr


def test_decode_side_against_the_gateways_copy_or_a_fingerprint(tmp_path):
    """A Mac compares its MLX folder with the gateway's copy (config and tokenizer, a few MB) or with the fingerprint
    the prefill machine printed, instead of holding the prefill checkpoint (65 GB for gpt-oss-120b)."""
    from kv_bridge.fingerprint import model_fingerprint

    gw = tmp_path / "gateway-copy"
    r = run("models", "prepare", "--config", str(config(tmp_path)), "--model", "m", "--role", "gateway",
            "--hf", str(MODEL_DIR), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    (tmp_path / "served").rename(gw)  # as if copied from the gateway box
    assert not list(gw.glob("*.safetensors"))
    r = run("models", "prepare", "--config", str(config(tmp_path)), "--model", "m", "--role", "decode",
            "--mlx", str(MODEL_DIR), "--against", str(gw), cwd=tmp_path)
    assert r.returncode == 0 and "fingerprints agree" in r.stdout and "no weights" in r.stdout, r.stdout + r.stderr
    fp = model_fingerprint(str(MODEL_DIR))
    r = run("models", "prepare", "--config", str(config(tmp_path)), "--model", "m", "--role", "decode",
            "--against", fp, cwd=tmp_path)
    assert r.returncode == 0 and "fingerprints agree" in r.stdout, r.stdout + r.stderr
    r = run("models", "prepare", "--config", str(config(tmp_path)), "--model", "m", "--role", "decode",
            "--against", "0123456789abcdef", cwd=tmp_path)
    assert r.returncode == 1 and "fingerprints differ" in r.stderr, r.stdout + r.stderr
    r = run("models", "prepare", "--config", str(config(tmp_path)), "--model", "m", "--role", "decode",
            "--against", "not-a-fingerprint", cwd=tmp_path)
    assert r.returncode == 1 and "neither a folder with config.json nor a fingerprint" in r.stderr, r.stderr


def _draft_config(tmp_path: Path) -> Path:
    text = config(tmp_path).read_text() + f'\n[models.speculative]\nmethod = "draft"\ndraft_path = "{tmp_path / "draft"}"\n'
    return write(tmp_path, text, "config.toml")


def test_draft_with_the_same_tokenizer_files_is_prepared_and_budgeted(tmp_path):
    """A draft (a tiny llama: SmolLM2's tokenizer) for a decode side of the same tokenizer: prepared, and the Mac's
    budget counts its weights and its own cache of a full-length prompt."""
    from backends.decode.budget import decode_budget
    from kv_bridge.config.settings import load_config

    tiny_models.build("llama", tmp_path / "served")
    draft = tiny_models.build("llama", tmp_path / "draft-src", seed=1, layers=2)
    cfg = _draft_config(tmp_path)
    r = run("models", "prepare", "--config", str(cfg), "--model", "m", "--role", "draft", "--mlx", str(draft),
            cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "same tokenizer files" in r.stdout and (tmp_path / "draft" / "config.json").is_file()
    s = load_config(cfg)
    items = dict(decode_budget(s, s.node("d"), s.models, cfg.parent).items)
    assert items["m draft weights"] > 0
    # 2 layers x 2 KV heads x 64 x K and V x float32, at max_model_len tokens
    assert items[f"m draft KV ({s.models[0].max_model_len} tokens)"] == pytest.approx(
        2 * 2 * 64 * 2 * 4 * s.models[0].max_model_len / 2**30)


def test_draft_with_another_tokenizer_is_refused(tmp_path):
    tiny_models.build("llama", tmp_path / "served")
    other = tiny_models.write_family_tokenizer(tiny_models.build("llama", tmp_path / "other"), "gpt_oss")
    r = run("models", "prepare", "--config", str(_draft_config(tmp_path)), "--model", "m", "--role", "draft",
            "--mlx", str(other), cwd=tmp_path)
    assert r.returncode == 1 and "different tokenizer" in r.stderr and "tokenizer.json model differs" in r.stderr
