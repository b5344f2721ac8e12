"""Learned drafters keep plain decoding's output: greedy equal token for token and seeded sampling equal to the plain
batch, with an EAGLE-3 head and a DFlash drafter drafting, in-process through the decode node's MLX loop on the tiny
random llama and gpt_oss (tests/support/tiny_models.py; gpt_oss past its 16-token window) and on smollm2:135m with
its trained head when `make draft-head` cached one, else a small untrained head. A drafter's quality never decides
a test: untrained drafters are refused nearly always, so a head with a one-token draft vocabulary and a DFlash
drafter built to echo that token, with a logit bias on it, make most drafts kept: kept drafts and the states they
leave behind are exercised as well as refused ones."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from backends.decode.engine import Job, MLXModel
from backends.decode.speculative.control import SpecController
from backends.decode.speculative.dflash import untrained_dflash
from backends.decode.speculative.eagle3 import untrained_eagle3
from backends.decode.speculative.hidden import target_args
from kv_bridge.config.speculative import SpeculativeConfig
from kv_bridge.protocol import Sampling
from tests.support.fakes import HeldKV
from tests.support.tiny_models import build

LAB = dict(temperature=0.2, top_p=0.9, seed=5)
PROMPT = [1, 504, 3458, 282, 4774, 30, 198, 2730, 314, 253, 1789, 28, 339, 1345, 2569, 29, 1048, 8340, 22, 288, 13,
          4217, 957, 36, 198, 1789, 28, 339, 1345]
SMOLLM2 = Path(__file__).resolve().parents[4] / "models" / "smollm2-135m"
TRAINED = SMOLLM2.parent / "smollm2-135m-eagle3"


def _drafters(path: str, folder: Path) -> dict:
    """method -> drafter folder for the model at `path`: eagle3 (untrained, a draft vocabulary), eagle3-one (drafts
    only token 504), dflash (untrained)."""
    from mlx_lm import load

    model, _ = load(path)
    t = target_args(model)
    return {"eagle3": untrained_eagle3(t, str(folder / "e3"), draft_ids=list(range(0, t["vocab_size"], 7))),
            "eagle3-one": untrained_eagle3(t, str(folder / "e3one"), draft_ids=[504]),
            "dflash": untrained_dflash(t, str(folder / "df")),
            "dflash-one": _echo_dflash(model, t, folder / "dfone")}


def _echo_dflash(model, t: dict, folder: Path) -> str:
    """A DFlash drafter that drafts 504 at every position: its layers add nothing (o_proj, down_proj zero), its mask
    token is 504, and its final norm's weight turns the normed embedding of 504 into the target's lm_head row for
    504 (whose dot product with itself wins the argmax on these random weights: checked)."""
    import mlx.core as mx

    path = untrained_dflash(t, str(folder), mask_token_id=504)
    w = mx.load(f"{path}/model.safetensors")
    w = {k: mx.zeros_like(v) if k.endswith(("o_proj.weight", "down_proj.weight")) else v for k, v in w.items()}
    e = model.model.embed_tokens(mx.array([504]))[0]
    e = e * mx.rsqrt(mx.mean(e * e) + 1e-6)
    w["norm.weight"] = model.lm_head.weight[504] / e
    assert mx.argmax(model.lm_head(w["norm.weight"] * e)).item() == 504
    mx.save_safetensors(f"{path}/model.safetensors", w)
    return path


def _node(path: str, method: str, draft: str) -> MLXModel:
    m = MLXModel("m", path, speculative=SpeculativeConfig(method=method, draft_path=draft))
    m.executor.submit(m.load).result()  # on the model's own thread, as the node loads it
    m.start()
    return m


@pytest.fixture(scope="module", params=["llama", "gpt_oss"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    path = str(build(request.param, folder / "model"))
    drafters = _drafters(path, folder)
    nodes = {}

    def node(method: str) -> MLXModel:  # one node per drafter, loaded once per model
        if method not in nodes:
            nodes[method] = _node(path, method.removesuffix("-one"), drafters[method])
        return nodes[method]
    yield node
    for m in nodes.values():
        m.stop()


def use(m: MLXModel, method: str) -> SpecController:
    m.speculation = SpecController(SpeculativeConfig(method=method, draft_path=None if method == "off" else "x",
                                                     num_draft=4, adaptive=False))
    return m.speculation


def generate(m: MLXModel, ids=PROMPT, **sampling) -> list[int]:
    out, done = [], threading.Event()
    gen = Sampling.from_json(sampling)
    job = Job(tokens=list(ids), gen=gen, emit=None, grammar=None)
    job.emit = lambda ev: done.set() if ev is None else out.append(ev)
    m.submit(job)
    assert done.wait(300)
    assert all(e[0] == "token" for e in out), out
    return [e[1].token_id for e in out]


def plain_and_spec(m: MLXModel, method: str, ids=PROMPT, **sampling):
    use(m, "off")  # the same node, its model wrapped: the batch's forwards are the model's own call
    plain = generate(m, ids, **sampling)
    ctl = use(m, method)
    return plain, generate(m, ids, **sampling), ctl


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_greedy_equals_plain_decoding(tiny, method):
    plain, spec, ctl = plain_and_spec(tiny(method), method, max_tokens=40, temperature=0.0)
    assert spec == plain and len(plain) == 40
    assert ctl.stats.requests == {"speculative": 1} and ctl.stats.verify_steps > 0


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_sampled_at_the_labs_settings_equals_plain_decoding(tiny, method):
    plain, spec, ctl = plain_and_spec(tiny(method), method, max_tokens=32, **LAB)
    assert spec == plain and ctl.stats.verify_steps > 0


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_kept_drafts_leave_the_drafter_in_step(tiny, method):
    """Drafts of 504 only and a bias that makes the target emit it mostly: most drafts are kept, and greedy and
    sampled output still equal plain decoding (the drafter drafts on from the kept tokens' states)."""
    m = tiny(f"{method}-one")
    for sampling in (dict(temperature=0.0), dict(temperature=0.3, seed=3)):
        plain, spec, ctl = plain_and_spec(m, method, max_tokens=40, logit_bias={504: 4.0}, **sampling)
        assert spec == plain
        assert ctl.stats.accepted > 0


def test_a_costly_head_is_asked_again_after_plain_steps(tiny):
    """Adaptive, as a node runs it: a head is a costly source (it drafts only when asked, so a plain step carries
    no draft of its own to score). It starts doubted, so the run pipelines plain steps; the pipeline must stop for
    the head's probes, and once its drafts are kept it drafts on. Before, a pipelined run never asked it again (the
    class replay's head drafted 0 tokens). Greedy output stays plain decoding's."""
    m = tiny("eagle3-one")
    use(m, "off")
    plain = generate(m, max_tokens=48, logit_bias={504: 4.0}, temperature=0.0)
    cfg = SpeculativeConfig(method="eagle3", draft_path="x", num_draft=3, verify_cost=0.1, probe_every=4)
    m.speculation = ctl = SpecController(cfg)
    ctl.draft_cost = lambda name, prior, depth: 0.05  # costly (> control.COSTLY) and cheap enough to pay, timed or not
    ctl.arms[("eagle3", 0)] = [0.0, 12.0]  # twelve refusals seen: off for its first probes
    spec = generate(m, max_tokens=48, logit_bias={504: 4.0}, temperature=0.0)
    assert spec == plain
    assert ctl.stats.plain_steps > 0 and ctl.stats.probes > 0
    assert ctl.stats.probes >= 2 and ctl.stats.by_source["eagle3"][1] >= 12  # on, after its probes were kept


def _untrained_head(path: str, tmp_path_factory) -> str:
    """An untrained EAGLE-3 head for the model at `path` (no trained one cached: `make draft-head` makes it)."""
    from mlx_lm import load

    t = target_args(load(path)[0])
    folder = tmp_path_factory.mktemp("smol") / "e3"
    return untrained_eagle3(t, str(folder), draft_ids=list(range(0, t["vocab_size"], 7)))


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    if not (SMOLLM2 / "config.json").is_file():
        pytest.skip("models/smollm2-135m missing: `make models`")
    head = str(TRAINED) if (TRAINED / "config.json").is_file() else _untrained_head(str(SMOLLM2), tmp_path_factory)
    m = _node(str(SMOLLM2), "eagle3", head)
    yield m
    m.stop()


@pytest.mark.e2e  # loads the embedded model (as test_speculative.py's node does): the serial tier
def test_smollm2_greedy_with_its_head_equals_plain_decoding(smollm2):
    ids = smollm2.tokenizer.encode("Speculative decoding drafts tokens that the model then verifies. In short,")
    plain, spec, ctl = plain_and_spec(smollm2, "eagle3", ids, max_tokens=24, temperature=0.0)
    assert spec == plain and ctl.stats.verify_steps > 0


def _bridged(m: MLXModel, ids: list[int], head_kv: bool = False, held: int = 0, **sampling) -> list[int]:
    """A generation from the prompt's KV handed over as a prefill node's arrives (MLX's own prefill of ids[:-1]): the
    node computed no hidden state for those positions, so the drafter starts with none; `head_kv`: the EAGLE-3 head's
    own KV of them arrives too (as a prefill node running the head sends it; here the head's MLX prefill); `held`:
    of the positions after the first `held` only, as after a prefix the Mac held."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from kv_bridge.mlx.cache import cache_kv

    model, _ = load(m.path)  # the same weights on this thread (the node's thread runs its loop)
    cache = make_prompt_cache(model)
    model(mx.array([ids[:-1]]), cache=cache)
    kv = cache_kv(cache, len(ids) - 1)
    draft = None
    if head_kv:
        from backends.decode.speculative.eagle3_source import head_prompt_kv

        def work():  # on the node's MLX thread, which holds the head and the tapped model
            yield
            return head_prompt_kv(m.draft_model, m.model, ids)
        k, v = m.submit_task(work).future.result(120)
        draft = (held, k[None, :, held:], v[None, :, held:])
    out, done = [], threading.Event()
    job = Job(tokens=ids[-1:], gen=Sampling.from_json(sampling), emit=None, history=ids[:-1],
              make_cache=lambda: m.prompt_cache(None, HeldKV(*kv)), draft_kv=draft)
    job.emit = lambda ev: done.set() if ev is None else out.append(ev)
    m.submit(job)
    assert done.wait(300)
    assert all(e[0] == "token" for e in out), out
    return [e[1].token_id for e in out]


@pytest.mark.parametrize("method", ["dflash"])  # EAGLE-3's: the test after the next, with its head's KV or not
def test_bridged_prompt_greedy_equals_plain_decoding(tiny, method):
    """The split's case: the prompt's KV arrives, its hidden states do not (the drafter's context starts at the last
    prompt token); kept drafts too (the echo drafters and a bias)."""
    m = tiny(f"{method}-one")
    sampling = dict(max_tokens=40, temperature=0.0, logit_bias={504: 4.0})
    use(m, "off")
    plain = _bridged(m, PROMPT, **sampling)
    ctl = use(m, method)
    assert _bridged(m, PROMPT, **sampling) == plain
    assert ctl.stats.requests == {"speculative": 1} and ctl.stats.accepted > 0


def test_bridged_prompt_with_and_without_the_heads_kv_greedy_equals_plain_decoding(tiny):
    """The prompt's KV arrives; the head's own prompt KV with it (the prefill node ran the head: installed, its
    context is the whole prompt) or not (its context starts at the last prompt token); output equals plain decoding
    either way, with kept drafts."""
    m = tiny("eagle3-one")
    sampling = dict(max_tokens=40, temperature=0.0, logit_bias={504: 4.0})
    use(m, "off")
    plain = _bridged(m, PROMPT, **sampling)
    for head_kv in (False, True):
        ctl = use(m, "eagle3")
        assert _bridged(m, PROMPT, head_kv=head_kv, **sampling) == plain
        assert ctl.stats.draft_kv_tokens == head_kv * (len(PROMPT) - 1) and ctl.stats.accepted > 0


HELD = 11  # prompt tokens the Mac held (a prefix-cache hit): the wire carries the rest, the head's KV of them too


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_the_drafters_kv_after_a_held_prefix_is_its_own_from_there(tiny, method):
    """With a prefix held on the Mac the prefill node sends the drafter's KV of positions [HELD, n - 1) only, rotated
    at those positions. Installed, the drafter's cache equals its own computation over the same rows started at
    position 0 (its context then starts there, as where this node computed no state), keys and values."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from backends.decode.speculative.dflash import DFlashSource, dflash_prompt_kv
    from backends.decode.speculative.eagle3_source import Eagle3Source, head_prompt_kv

    m = tiny(method)

    def work():
        yield
        d, tap = m.draft_model, m.model
        cache, got = make_prompt_cache(tap.model), []
        tap.listen(cache, lambda start, hidden: got.append(hidden))
        tap(mx.array([PROMPT[:-1]]), cache=cache)
        tap.listen(cache, None)
        if method == "eagle3":  # the whole prompt's, at its absolute positions; and the rows HELD.. alone from 0
            k, v = (a[None] for a in head_prompt_kv(d, tap, PROMPT))
            own = [KVCache()]
            d(tap.embed(mx.array([PROMPT[HELD + 1:]])), d.fuse(got[0][:, HELD:]), own)
            src = Eagle3Source(d, tap, list(PROMPT), make_prompt_cache(tap.model))
        else:
            k, v = dflash_prompt_kv(d, tap, PROMPT)
            own = [KVCache() for _ in d.layers]
            d.add_context(got[0][:, HELD:], own)
            src = DFlashSource(d, tap, list(PROMPT), make_prompt_cache(tap.model))
        assert src.install_prompt_kv(HELD, k[:, :, HELD:], v[:, :, HELD:])
        assert src.next == len(PROMPT) - 1
        pairs = []
        for c, o in zip(src.cache, own):
            assert c.offset == o.offset == len(PROMPT) - 1 - HELD
            pairs.append([np.array(a[0, :, :c.offset].astype(mx.float32)) for a in (c.keys, c.values, o.keys, o.values)])
        src.close()
        return pairs
    for ks, vs, kr, vr in m.submit_task(work).future.result(120):
        np.testing.assert_allclose(vs, vr, atol=1e-5)
        np.testing.assert_allclose(ks, kr, atol=1e-4)
        assert np.abs(ks - kr).max() < 0.01 * np.abs(kr).max()


def test_bridged_after_a_held_prefix_with_the_heads_kv_equals_plain_decoding(tiny):
    """The split after a prefix-cache hit: the head's KV of the prompt after the held prefix is installed (counted),
    kept drafts follow, and greedy output equals plain decoding."""
    m = tiny("eagle3-one")
    sampling = dict(max_tokens=40, temperature=0.0, logit_bias={504: 4.0})
    use(m, "off")
    plain = _bridged(m, PROMPT, **sampling)
    ctl = use(m, "eagle3")
    assert _bridged(m, PROMPT, head_kv=True, held=HELD, **sampling) == plain
    assert ctl.stats.draft_kv_tokens == len(PROMPT) - 1 - HELD and ctl.stats.accepted > 0
