"""`disagg models prepare --role draft` for a learned drafter (method eagle3 / dflash): the drafter's folder linked at
speculative.draft_path and its config checked against the decode side's config.json (a head for another model
refused naming the field); the Mac's budget counts its weights and its KV of a full-length prompt."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support import tiny_models
from tests.support.cli import run, write


def _config(tmp_path: Path, method: str, prefill_head: bool = False) -> Path:
    prefill = f'prefill_draft_path = "{tmp_path / "prefill-head"}"' if prefill_head else ""
    return write(tmp_path, f"""
[[nodes]]
name = "d"
role = "decode"
port = 8200
kv_port = 8201

[[models]]
id = "m"
path = "{tmp_path / 'served'}"
decode = ["d"]
{prefill}

[models.speculative]
method = "{method}"
draft_path = "{tmp_path / 'head'}"
""", "config.toml")


def _target(folder: Path) -> dict:
    from backends.decode.speculative.learned_load import target_from_config

    return target_from_config(json.loads((folder / "config.json").read_text()))


def test_a_head_for_the_model_is_prepared_and_budgeted(tmp_path):
    from backends.decode.budget import decode_budget
    from backends.decode.speculative.eagle3 import untrained_eagle3
    from kv_bridge.config.settings import load_config

    served = tiny_models.build("llama", tmp_path / "served")
    src = untrained_eagle3(_target(served), str(tmp_path / "src"), attention=(4, 2, 64))  # the model's KV shape
    cfg = _config(tmp_path, "eagle3", prefill_head=True)
    r = run("models", "prepare", "--config", str(cfg), "--model", "m", "--role", "draft", "--mlx", src, cwd=tmp_path)
    assert r.returncode == 0 and "eagle3 drafter ready" in r.stdout, r.stdout + r.stderr
    assert "the prefill nodes' eagle3 drafter ready" in r.stdout  # [[models]] prefill_draft_path: checked for vLLM
    assert "layers [2, 2, 1]" in r.stdout  # vLLM's default for a 4-layer target: 2, L // 2, L - 3
    s = load_config(cfg)
    items = dict(decode_budget(s, s.node("d"), s.models, cfg.parent).items)
    assert items["m draft weights"] > 0 and items[f"m draft KV ({s.models[0].max_model_len} tokens)"] > 0


def test_a_drafter_for_another_model_is_refused_naming_the_field(tmp_path):
    """The check prepare runs (the CLI path itself is the test above's)."""
    import pytest

    from backends.decode.speculative.dflash import untrained_dflash
    from backends.decode.speculative.learned_load import check_folder

    served = tiny_models.build("llama", tmp_path / "served")
    src = untrained_dflash(_target(tiny_models.build("gpt_oss", tmp_path / "other")), str(tmp_path / "src"))
    with pytest.raises(ValueError, match="rope_theta"):
        check_folder("dflash", src, served)
    assert "block 8" in check_folder("dflash", untrained_dflash(_target(served), str(tmp_path / "ok")), served)
