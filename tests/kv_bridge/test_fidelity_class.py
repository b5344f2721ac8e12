"""The canary's allowance class from both sides' weights (issue #50): each node's weight_precision (config.json:
vLLM's quantization_config, mlx-lm's quantization bits and mode) and allowance_class of the pair."""

from __future__ import annotations

import json

import pytest

from kv_bridge.fidelity import allowance_class
from kv_bridge.fingerprint import weight_precision

NONE, FP8, MXFP4 = {"scheme": "none", "bits": None}, {"scheme": "fp8", "bits": 8}, {"scheme": "mxfp4", "bits": 4}
MLX4, MLX8 = {"scheme": "affine", "bits": 4}, {"scheme": "affine", "bits": 8}


@pytest.mark.parametrize("config, want", [
    ({"torch_dtype": "bfloat16"}, NONE),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, FP8),
    ({"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}},
     MXFP4),
    ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}, {"scheme": "nvfp4", "bits": 4}),
    ({"quantization_config": {"quant_method": "compressed-tensors",
                              "config_groups": {"g": {"weights": {"num_bits": 8}}}}},
     {"scheme": "compressed-tensors", "bits": 8}),
    ({"quantization": {"group_size": 64, "bits": 4}}, MLX4),
    ({"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}, MXFP4),
    ({"quantization": {"group_size": 64, "bits": 8}, "quantization_config": {"quant_method": "fp8"}}, MLX8),
])
def test_each_side_reports_its_weights_quantization(tmp_path, config, want):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert weight_precision(tmp_path) == want


@pytest.mark.parametrize("prefill, decode, want", [
    (NONE, NONE, "full"),
    (MXFP4, MXFP4, "full"),  # gpt-oss: the checkpoint's MXFP4 experts on a Spark and on a Mac
    (FP8, NONE, "8"),  # a bf16 Mac behind an FP8 Spark
    (FP8, MLX4, "4"),  # Qwen3-Coder FP8 on a Spark, MLX 4-bit on a Mac
    (NONE, MLX8, "8"),
    (MXFP4, MLX4, "4"),
    (None, MLX4, "4"),  # a prefill side that does not say: unquantized (the Mac's bits decide, as before)
    (None, None, "full"),
])
def test_the_class_comes_from_the_pair(prefill, decode, want):
    assert allowance_class(prefill, decode) == want
