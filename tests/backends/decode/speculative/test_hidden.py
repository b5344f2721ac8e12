"""The target's forward with hidden states (HiddenTap) gives the model's own logits, bit for bit, over the same
cache schedule, and the states at the chosen layers; forwards over caches nobody listens on are the model's own call."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from backends.decode.speculative.hidden import HiddenTap
from tests.support.tiny_models import build

IDS = [1, 504, 3458, 282, 4774, 30, 198, 2730, 314, 253, 1789, 28, 339, 1345, 2569, 29, 1048, 8340, 22, 288, 13]


@pytest.mark.parametrize("model_type", ["llama", "gpt_oss", "qwen3_moe"])
def test_logits_equal_the_models_own_call(tmp_path, model_type):
    """A prompt in two chunks then single tokens (gpt_oss: past its 16-token window), on two fresh caches."""
    model, _ = load(str(build(model_type, tmp_path)))
    tap = HiddenTap(model, [0, 2, 4])
    seen = []
    own, tapped = make_prompt_cache(model), make_prompt_cache(model)
    tap.listen(tapped, lambda start, h: seen.append((start, h.shape)))
    for chunk in (IDS[:12], IDS[12:], [7], [8]):
        a = model(mx.array([chunk]), cache=own)
        b = tap(mx.array([chunk]), cache=tapped)
        assert mx.array_equal(a, b).item()
    hidden = model.args.hidden_size
    assert seen == [(0, (1, 12, 3 * hidden)), (12, (1, len(IDS) - 12, 3 * hidden)), (len(IDS), (1, 1, 3 * hidden)),
                    (len(IDS) + 1, (1, 1, 3 * hidden))]


def test_states_are_the_residual_stream_at_the_chosen_layers(tmp_path):
    """Point 0 is the embeddings; the last point is the final layer's output (before the norm)."""
    model, _ = load(str(build("llama", tmp_path)))
    n = model.args.num_hidden_layers
    tap = HiddenTap(model, [0, n])
    _, h = tap.forward(mx.array([IDS]), make_prompt_cache(model))
    size = model.args.hidden_size
    assert mx.allclose(h[..., :size], model.model.embed_tokens(mx.array([IDS]))).item()
    normed = model.model.norm(h[..., size:])
    assert mx.allclose(tap.logits(normed), model(mx.array([IDS])), atol=1e-4).item()


def test_unheard_caches_and_unknown_families(tmp_path):
    model, _ = load(str(build("llama", tmp_path)))
    tap = HiddenTap(model, [1])
    cache = make_prompt_cache(tap)  # make_cache / layers reach the model through the wrapper
    assert mx.array_equal(tap(mx.array([IDS]), cache=cache), model(mx.array([IDS]))).item()
    model.args.model_type = "mamba"
    with pytest.raises(ValueError, match="mamba"):
        HiddenTap(model, [1])
