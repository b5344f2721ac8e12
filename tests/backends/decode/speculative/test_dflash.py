"""DFlash drafters as z-lab publishes them (DFlashDraftModel, dflash_config.target_layer_ids / mask_token_id,
block_size, num_target_layers): the config checked against the site models, a mismatch refused naming the field, a
drafter in the published layout loaded, and one block drafting block_size - 1 tokens from the context it holds."""

from __future__ import annotations

import pytest

from backends.decode.speculative.dflash import DFlashConfig, default_layer_ids, load_dflash, untrained_dflash

QWEN3_CODER_30B = {"model_type": "qwen3_moe", "hidden_size": 2048, "vocab_size": 151936, "num_hidden_layers": 48,
                   "rope_theta": 10000000.0, "rope_scaling": None}
# z-lab/Qwen3-Coder-30B-A3B-DFlash, in the fields of z-lab's published Qwen3 drafters (Qwen3-8B-DFlash-b16: 5 layers,
# target layers 1..L-3 evenly, mask token <|MASK|> past the Qwen3 vocabulary's text ids); values are the target's.
ZLAB_QWEN3_CODER = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 12, 23, 34, 45]},
    "head_dim": 128, "hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 32,
    "num_key_value_heads": 4, "num_hidden_layers": 5, "num_target_layers": 48, "rms_norm_eps": 1e-06,
    "rope_theta": 10000000, "rope_scaling": None, "max_position_embeddings": 262144, "vocab_size": 151936,
    "layer_types": ["full_attention"] * 5, "tie_word_embeddings": False}


def test_zlab_layer_ids_are_their_default():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab/Qwen3-8B-DFlash-b16's published ids
    assert default_layer_ids(48, 5) == ZLAB_QWEN3_CODER["dflash_config"]["target_layer_ids"]


def test_published_drafter_fits_its_site_model():
    cfg = DFlashConfig.from_dict(ZLAB_QWEN3_CODER)
    cfg.check(QWEN3_CODER_30B)
    assert (cfg.block_size, cfg.mask_token_id, cfg.num_hidden_layers) == (16, 151669, 5)


@pytest.mark.parametrize("change, field", [
    ({"num_target_layers": 36}, "num_target_layers"),
    ({"hidden_size": 4096}, "hidden_size"),
    ({"rope_theta": 1000000}, "rope_theta"),
    ({"dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 12, 23, 34, 50]}}, "target_layer_ids"),
    ({"layer_types": ["sliding_attention"] * 5}, "layer_types"),
    ({"architectures": ["Qwen3ForCausalLM"]}, "DFlashDraftModel"),
])
def test_a_drafter_for_another_target_is_refused_naming_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        DFlashConfig.from_dict({**ZLAB_QWEN3_CODER, **change}).check(QWEN3_CODER_30B)


def test_a_block_drafts_from_the_context(tmp_path):
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    target = {**QWEN3_CODER_30B, "hidden_size": 64, "vocab_size": 300, "num_hidden_layers": 8}
    drafter = load_dflash(untrained_dflash(target, str(tmp_path / "d"), layers=2, block_size=4), target)
    assert drafter.cfg.target_layer_ids == [1, 5]
    cache = [KVCache() for _ in drafter.layers]
    drafter.add_context(mx.random.normal((1, 6, 2 * 64)), cache)
    out = drafter(mx.random.normal((1, 4, 64)), cache)
    assert out.shape == (1, 4, 64) and cache[0].offset == 6  # the block itself is not cached
    with pytest.raises(ValueError, match="vocab_size"):
        load_dflash(str(tmp_path / "d"), {**target, "vocab_size": 301})
