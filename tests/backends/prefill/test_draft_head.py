"""The EAGLE-3 head a prefill node runs: checked from its config files at start, each refusal naming the fix."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from backends.prefill.draft_head import check_head, speculative_config
from kv_bridge.config.models import ModelRoute

MODEL = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}
HEAD = {"architectures": ["LlamaForCausalLMEagle3"], **MODEL, "torch_dtype": "float32"}


def _folder(path: Path, cfg: dict, metadata=None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    header = json.dumps({"__metadata__": metadata, "fc.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode() + b"\0" * 4)
    return path


def test_a_head_with_the_models_kv_shape_is_started_with_one_speculative_token(tmp_path):
    model, head = _folder(tmp_path / "m", MODEL), _folder(tmp_path / "h", HEAD)
    route = ModelRoute(id="m", path=str(model), decode=["d"], prefill_draft_path=str(head))
    assert speculative_config(route, model) == {"method": "eagle3", "model": str(head), "num_speculative_tokens": 1}
    assert speculative_config(ModelRoute(id="m", path=str(model), decode=["d"]), model) is None


def test_a_dflash_drafter_is_started_as_vllm_starts_one_and_declares_its_layers(tmp_path):
    from kv_bridge.fingerprint import drafter_layers

    model = _folder(tmp_path / "m", MODEL)
    dflash = _folder(tmp_path / "d", {**HEAD, "architectures": ["DFlashDraftModel"], "num_hidden_layers": 5})
    route = ModelRoute(id="m", path=str(model), decode=["d"], prefill_draft_path=str(dflash))
    assert speculative_config(route, model)["method"] == "dflash" and drafter_layers(dflash) == 5
    with pytest.raises(ValueError, match=r"differs from the model's \(3, 64\)"):
        check_head(_folder(tmp_path / "d2", {**HEAD, "architectures": ["DFlashDraftModel"], "head_dim": 128}), model)


@pytest.mark.parametrize("reach,warned", [(None, True), (1024, True), (8192, False)])
def test_a_head_that_reaches_short_of_max_model_len_is_named_at_start(tmp_path, caplog, reach, warned):
    """vLLM runs the head only over prompts within its max_model_len, which it reads from the head's
    max_position_embeddings (LlamaConfig's 2048 where absent): longer prompts then carry no head KV. Said at start."""
    model = _folder(tmp_path / "m", MODEL)
    head = _folder(tmp_path / "h", {**HEAD, **({"max_position_embeddings": reach} if reach else {})})
    route = ModelRoute(id="m", path=str(model), decode=["d"], prefill_draft_path=str(head), max_model_len=4096)
    with caplog.at_level("WARNING", logger="backends.prefill.node"):
        assert speculative_config(route, model)["model"] == str(head)
    text = caplog.text
    assert ("max_position_embeddings is" in text) == warned
    if warned:
        assert f"is {reach or 2048}" in text and "max_model_len 4096" in text


@pytest.mark.parametrize("change,match", [
    ({"architectures": ["LlamaForCausalLM"]}, "neither an EAGLE-3 head .* nor a DFlash drafter"),
    ({"num_key_value_heads": 1}, r"\(num_key_value_heads, head_dim\) \(1, 64\) differs from the model's \(3, 64\)"),
    ({"torch_dtype": None}, 'add "torch_dtype" \\(float32\\)'),
])
def test_a_head_that_cannot_ride_the_stream_is_refused_by_field(tmp_path, change, match):
    model = _folder(tmp_path / "m", MODEL)
    head = _folder(tmp_path / "h", {**HEAD, **change})
    with pytest.raises(ValueError, match=match):
        check_head(head, model)


def test_a_head_without_torch_dtype_but_with_safetensors_metadata_passes(tmp_path):
    model = _folder(tmp_path / "m", MODEL)
    head = _folder(tmp_path / "h", {**HEAD, "torch_dtype": None}, metadata={"format": "pt"})
    assert check_head(head, model)["num_key_value_heads"] == 3
