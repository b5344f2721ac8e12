"""Prefix-aware transfer, gateway side, over real HTTP against fake nodes: the decode node's kv_start goes to the
prefill call, a decode node holding the whole range gets no prefill call, and headers and metrics report it."""

from __future__ import annotations

from tests.support.fakes import LONG_TEXT, MODEL_DIR, MODEL_ID, chat_body
from gateway.text.tokenizer import ChatTokenizer

PROMPT = ChatTokenizer.from_folder(MODEL_DIR).encode_chat([{"role": "user", "content": LONG_TEXT}])
PREFIX = "disagg_prefix_tokens_total"


async def test_prefill_sends_only_what_decode_lacks(cluster):
    cluster.decode.held_prefix = 20
    before = await cluster.metric(PREFIX, model=MODEL_ID)
    status, headers, body = await cluster.chat(chat_body(LONG_TEXT, max_tokens=4))
    assert status == 200, body
    pre = cluster.prefill.requests[-1]
    assert pre["kv_start"] == 20 and pre["token_ids"] == PROMPT[:-1]
    assert headers["x-disagg-path"] == "disaggregated"
    assert headers["x-disagg-prefix-tokens"] == "20"
    assert headers["x-disagg-kv-tokens"] == str(len(PROMPT) - 1 - 20)  # what crossed the network
    assert await cluster.metric(PREFIX, model=MODEL_ID) == before + 20


async def test_no_prefill_call_when_decode_holds_everything(cluster):
    cluster.decode.held_prefix = 10**6
    status, headers, body = await cluster.chat(chat_body(LONG_TEXT, max_tokens=4))
    assert status == 200, body
    assert cluster.prefill.requests == []
    assert headers["x-disagg-path"] == "disaggregated"  # planned so, and no token was recomputed but the last
    assert headers["x-disagg-prefix-tokens"] == str(len(PROMPT) - 1)
    assert headers["x-disagg-kv-tokens"] == "0" and headers["x-disagg-prefill-ms"] == "0"
    assert cluster.decode.aborts == []


async def test_cold_decode_node_asks_for_everything(cluster):
    status, headers, body = await cluster.chat(chat_body(LONG_TEXT, max_tokens=4))
    assert status == 200, body
    assert cluster.prefill.requests[-1]["kv_start"] == 0
    assert headers["x-disagg-prefix-tokens"] == "0"
    assert headers["x-disagg-kv-tokens"] == str(len(PROMPT) - 1)


async def test_local_path_reports_no_prefix_header_value(cluster):
    status, headers, _ = await cluster.chat(chat_body("hi"))
    assert status == 200 and headers["x-disagg-path"] == "local" and headers["x-disagg-prefix-tokens"] == "0"


async def test_bad_kv_start_from_decode_is_a_node_failure(cluster, caplog):
    cluster.decode.held_prefix = -1  # the fake then announces kv_start -1
    failed = await cluster.metric("disagg_fallbacks_total", model=MODEL_ID, reason="decode_node_failed")
    status, _, body = await cluster.chat(chat_body(LONG_TEXT, max_tokens=4))
    assert status == 503, body
    assert f"sent kv_start -1 outside [0, {len(PROMPT) - 1}]" in caplog.text
    assert await cluster.metric("disagg_fallbacks_total", model=MODEL_ID, reason="decode_node_failed") == failed + 1
    assert cluster.prefill.requests == []
