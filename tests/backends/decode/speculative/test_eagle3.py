"""EAGLE-3 heads as published: the config fields NVIDIA's and SpecForge's heads write (vLLM's names), checked against
the site models' configs and refused on a mismatch naming the field; a head written in the published layout loads
(midlayer.*, d2t) and drafts through the draft vocabulary."""

from __future__ import annotations

import pytest

from backends.decode.speculative.eagle3 import Eagle3Config, load_eagle3, untrained_eagle3
from backends.decode.speculative.hidden import target_args

# The site models, as their config.json files read (target_args' fields).
GPT_OSS_120B = {"model_type": "gpt_oss", "hidden_size": 2880, "vocab_size": 201088, "num_hidden_layers": 36,
                "rope_theta": 150000.0, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                         "original_max_position_embeddings": 4096,
                                                         "rope_type": "yarn", "truncate": False}}
QWEN3_CODER_30B = {"model_type": "qwen3_moe", "hidden_size": 2048, "vocab_size": 151936, "num_hidden_layers": 48,
                   "rope_theta": 10000000.0, "rope_scaling": None}

# nvidia/gpt-oss-120b-Eagle3: ModelOpt's export (eagle_config with its layer ids and flags), the target's yarn RoPE;
# no draft_vocab_size (vLLM then drafts over the whole vocabulary). Written from the published field names; values we
# could not read offline are the target's.
NVIDIA_GPT_OSS = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 17, 33], "use_aux_hidden_state": True,
                     "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                     "use_mtp_layernorm": False},
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 17280,
    "max_position_embeddings": 131072, "num_attention_heads": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 150000, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                           "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                           "truncate": False},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 201088}
# SpecForge's config for gpt-oss-120B (configs/gpt-oss-120B-eagle3.json): no RoPE fields, so LlamaConfig's 10000.
SPECFORGE_GPT_OSS = {
    "architectures": ["LlamaForCausalLMEagle3"], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 17, 33]},
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 17280,
    "max_position_embeddings": 4096, "model_type": "llama", "num_attention_heads": 64, "num_key_value_heads": 8,
    "num_hidden_layers": 1, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "vocab_size": 201088,
    "draft_vocab_size": 32000}
# lmsys/SGLang-EAGLE3-Qwen3-Coder-30B-A3B-Instruct-SpecForge: SpecForge's Qwen3 head fields (no eagle_config: vLLM's
# default layers 2, 24, 45), the target's RoPE.
LMSYS_QWEN3_CODER = {
    "architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 12288, "max_position_embeddings": 262144, "model_type": "llama",
    "num_attention_heads": 32, "num_key_value_heads": 4, "num_hidden_layers": 1, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 10000000, "tie_word_embeddings": False, "vocab_size": 151936,
    "draft_vocab_size": 32000}


def test_published_heads_fit_their_site_models():
    nv = Eagle3Config.from_dict(NVIDIA_GPT_OSS)
    nv.check(GPT_OSS_120B, own_embed=False)
    assert nv.aux_layers(GPT_OSS_120B) == [1, 17, 33] and nv.draft_vocab_size == 201088
    qw = Eagle3Config.from_dict(LMSYS_QWEN3_CODER)
    qw.check(QWEN3_CODER_30B, own_embed=False)
    assert qw.aux_layers(QWEN3_CODER_30B) == [2, 24, 45] and qw.head_dim == 128


@pytest.mark.parametrize("head, target, field", [
    (NVIDIA_GPT_OSS, QWEN3_CODER_30B, "target_hidden_size"),  # the other site model
    (LMSYS_QWEN3_CODER, GPT_OSS_120B, "target_hidden_size"),
    ({**LMSYS_QWEN3_CODER, "vocab_size": 151669}, QWEN3_CODER_30B, "vocab_size"),
    (SPECFORGE_GPT_OSS, GPT_OSS_120B, "rope_theta"),  # trained at LlamaConfig's default theta
    ({**NVIDIA_GPT_OSS, "rope_scaling": None}, GPT_OSS_120B, "rope_scaling"),  # a short-context head
    ({**LMSYS_QWEN3_CODER, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 24, 60]}}, QWEN3_CODER_30B,
     "eagle_aux_hidden_state_layer_ids"),
])
def test_a_head_for_another_target_is_refused_naming_the_field(head, target, field):
    with pytest.raises(ValueError, match=field):
        Eagle3Config.from_dict(head).check(target, own_embed=False)


def test_not_an_eagle3_head_is_refused():
    with pytest.raises(ValueError, match="LlamaForCausalLMEagle3"):
        Eagle3Config.from_dict({**LMSYS_QWEN3_CODER, "architectures": ["LlamaForCausalLM"]})


def test_a_published_layout_head_loads_and_drafts_through_d2t(tmp_path):
    """midlayer.* names, d2t offsets: draft id i is target id i + d2t[i]."""
    import mlx.core as mx

    target = {**QWEN3_CODER_30B, "hidden_size": 64, "vocab_size": 500, "num_hidden_layers": 6}
    ids = list(range(100, 500, 4))
    head = load_eagle3(untrained_eagle3(target, str(tmp_path / "h"), draft_ids=ids), target)
    assert head.lm_head.weight.shape == (len(ids), 64)
    assert head.to_target(mx.array([0, 5, len(ids) - 1])).tolist() == [100, 120, 496]
    with pytest.raises(ValueError, match="rope_theta"):
        load_eagle3(str(tmp_path / "h"), {**target, "rope_theta": 1e6})


def test_a_head_with_the_targets_vocabulary_is_saved_without_d2t_and_loads(tmp_path):
    """vLLM's Eagle3 head has no d2t parameter when the vocabularies are one, and refuses to start on a file with it
    (a clean clone's e2e setup error: its untrained head); with a draft vocabulary, d2t is written."""
    import mlx.core as mx

    target = {**QWEN3_CODER_30B, "hidden_size": 64, "vocab_size": 500, "num_hidden_layers": 6}
    full = untrained_eagle3(target, str(tmp_path / "full"))
    assert "d2t" not in mx.load(f"{full}/model.safetensors")
    assert load_eagle3(full, target).to_target(mx.array([7])).tolist() == [7]
    small = untrained_eagle3(target, str(tmp_path / "small"), draft_ids=list(range(100, 200)))
    assert "d2t" in mx.load(f"{small}/model.safetensors")


def test_target_args_reads_the_mlx_model(tmp_path):
    from mlx_lm import load

    from tests.support.tiny_models import build

    model, _ = load(str(build("gpt_oss", tmp_path)))
    t = target_args(model)
    assert (t["hidden_size"], t["num_hidden_layers"], t["rope_scaling"]["rope_type"]) == (128, 4, "yarn")
