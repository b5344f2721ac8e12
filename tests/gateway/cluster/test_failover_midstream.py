"""Mid-stream decode failover with fake nodes over real HTTP: decode-0 breaks after k tokens (TCP cut, or an error
line), and the same client stream goes on on decode-1 with prompt + generated ids and max_tokens less what was
produced; the client's text, finish reason and usage are those of an uninterrupted run, for chat, completions and
Ollama, streaming or not; a stop string spanning the break is still caught; with no other node the stream ends
with an error event as before.
"""

from __future__ import annotations

import json

import pytest

from tests.support.fakes import MODEL_ID, REPLY, Cluster, chat_body

# The gateway polls health every 30 s here, so only the request path can notice a broken node.
SLOW_POLL = {"interval": 30.0}
MAX_TOKENS = 32


@pytest.fixture
async def pair(empty_config):
    """Two continuing decode nodes, no prefill node; requests go to decode-0 first (ties pick the earlier)."""
    c = await Cluster(n_decode=2, n_prefill=0, **SLOW_POLL).start()
    for d in c.decoders:
        d.continues = True
    yield c
    await c.stop()


def content(events: list) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if isinstance(e, dict) and e["choices"])


async def failovers(c: Cluster) -> float:
    return await c.metric("disagg_fallbacks_total", model=MODEL_ID, reason="decode_failover")


async def reference(c: Cluster, path: str, body: dict) -> tuple[int, dict, list]:
    """The same request with nothing broken."""
    mode = c.decoders[0].mode
    c.decoders[0].mode = None
    try:
        return await c.events(path, body)
    finally:
        c.decoders[0].mode = mode


@pytest.mark.parametrize("mode", ["drop_mid_stream", "fail_mid_stream"])
async def test_streaming_chat_continues_on_the_other_node(pair, mode):
    body = chat_body(max_tokens=MAX_TOKENS, temperature=0, stream_options={"include_usage": True})
    _, _, ref = await reference(pair, "/v1/chat/completions", body)
    pair.decoders[0].mode, pair.decoders[0].break_after = mode, 3
    # Lines that arrive together with a TCP cut are lost with it (aiohttp raises before handing them out): pace them.
    pair.decoders[0].token_delay = 0.05
    status, headers, events = await pair.events("/v1/chat/completions", body)
    assert status == 200 and headers["x-disagg-decode-node"] == "decode-0"  # sent before the break
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert content(events) == content(ref) == REPLY
    assert events[-2]["usage"] == ref[-2]["usage"]  # the client's prompt, every token generated for it
    assert [e["choices"][0]["finish_reason"] for e in events[:-2] if e["choices"][0]["finish_reason"]] == ["stop"]
    first, cont = pair.decoders[0].requests[-1], pair.decoders[1].requests[-1]
    reply_ids = pair.decoders[0].reply_ids
    k = len(cont["token_ids"]) - len(first["token_ids"])  # what the gateway had received: the 3 sent, or fewer
    assert k == 3 or (mode == "drop_mid_stream" and 0 <= k < 3)
    assert cont["token_ids"] == first["token_ids"] + reply_ids[:k]
    assert cont["max_tokens"] == MAX_TOKENS - k
    assert {k: v for k, v in cont.items() if k not in ("request_id", "token_ids", "max_tokens")} == \
        {k: v for k, v in first.items() if k not in ("request_id", "token_ids", "max_tokens")}
    assert await failovers(pair) == 1
    async with pair.http.get(f"{pair.url}/health") as r:
        up = {n["name"]: n["up"] for n in (await r.json())["nodes"]}
    assert up == {"decode-0": True, "decode-1": True}  # the broken node's health is checked at once: still ok


async def test_a_broken_node_whose_health_fails_is_marked_down_at_once(pair):
    pair.decoders[0].mode = "fail_mid_stream"
    pair.decoders[0].down = True  # /health answers 503 from now on (the poll would notice only in 30 s)
    status, _, body = await pair.chat(chat_body(max_tokens=MAX_TOKENS, temperature=0))
    assert status == 200 and body["choices"][0]["message"]["content"] == REPLY
    async with pair.http.get(f"{pair.url}/health") as r:
        up = {n["name"]: n["up"] for n in (await r.json())["nodes"]}
    assert up == {"decode-0": False, "decode-1": True}


async def test_non_streaming_chat_reports_the_failover_in_headers(pair):
    pair.decoders[0].mode, pair.decoders[0].break_after = "drop_mid_stream", 4
    status, headers, body = await pair.chat(chat_body(max_tokens=MAX_TOKENS, temperature=0))
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == REPLY
    assert body["choices"][0]["finish_reason"] == "stop"
    prompt_tokens = len(pair.decoders[0].requests[-1]["token_ids"])
    n = len(pair.decoders[0].reply_ids)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
    assert headers["x-disagg-fallbacks"] == "decode_failover"
    assert headers["x-disagg-decode-node"] == "decode-1"


async def test_max_tokens_counts_what_the_broken_node_produced(pair):
    pair.decoders[0].mode, pair.decoders[0].break_after = "fail_mid_stream", 2
    status, _, body = await pair.chat(chat_body(max_tokens=5, temperature=0))
    assert status == 200
    assert body["choices"][0]["message"]["content"] == pair.decoders[0].reply_text(5)
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 5


async def test_a_break_after_the_last_token_needs_no_other_node(pair):
    """The node died between its max_tokens-th token and its done line: nothing is missing."""
    pair.decoders[0].mode, pair.decoders[0].break_after = "drop_mid_stream", 5
    pair.decoders[0].token_delay = 0.05  # the last token line must not arrive together with the cut
    status, _, body = await pair.chat(chat_body(max_tokens=5, temperature=0))
    assert status == 200
    assert body["choices"][0]["message"]["content"] == pair.decoders[0].reply_text(5)
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 5
    assert not pair.decoders[1].requests and await failovers(pair) == 0


@pytest.mark.parametrize("stop", [" is Paris", "France is", "Paris"])
async def test_a_stop_string_spanning_the_break_is_caught(pair, stop):
    """decode-0 breaks after " is" (4 tokens in); the stop string may have begun in the text it held back."""
    body = chat_body(max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    _, _, ref = await reference(pair, "/v1/chat/completions", body)
    pair.decoders[0].mode, pair.decoders[0].break_after = "drop_mid_stream", 5
    _, _, events = await pair.events("/v1/chat/completions", body)
    assert content(events) == content(ref) == REPLY[:REPLY.index(stop)]
    finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"][0]["finish_reason"]]
    assert finish == ["stop"]
    assert pair.decoders[1].requests[-1]["stop"] == []  # the gateway matches from the break on
    assert await failovers(pair) == 1


async def test_completions_streaming_continues(pair):
    body = {"model": MODEL_ID, "prompt": "Tell me:", "max_tokens": MAX_TOKENS, "temperature": 0}
    pair.decoders[0].mode = "drop_mid_stream"
    status, _, events = await pair.events("/v1/completions", body)
    assert status == 200 and events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == REPLY


@pytest.mark.parametrize("stream", [True, False])
async def test_ollama_generate_continues(pair, stream):
    pair.decoders[0].mode = "fail_mid_stream"
    body = {"model": MODEL_ID, "prompt": "What is the capital of France?", "stream": stream,
            "options": {"temperature": 0}}
    async with pair.http.post(f"{pair.url}/api/generate", json=body) as r:
        assert r.status == 200
        lines = [json.loads(ln) for ln in (await r.text()).splitlines() if ln.strip()]
    assert not any("error" in ln for ln in lines)
    assert "".join(ln["response"] for ln in lines) == REPLY
    last = lines[-1]
    assert last["done"] is True and last["eval_count"] == len(pair.decoders[0].reply_ids)
    assert last["context"][-len(pair.decoders[0].reply_ids):] == pair.decoders[0].reply_ids
    assert last["prompt_eval_count"] == len(pair.decoders[0].requests[-1]["token_ids"])


async def test_no_other_node_keeps_the_error_event(pair):
    await pair.decoders[1].stop()  # refuses connections; the gateway still believes it is up
    pair.decoders[0].mode = "fail_mid_stream"
    status, _, events = await pair.events("/v1/chat/completions", chat_body(max_tokens=MAX_TOKENS))
    assert status == 200 and events[-1] == "[DONE]" and "error" in events[-2]
    assert content(events[:-2]) == pair.decoders[0].reply_text(2)
    assert await failovers(pair) == 0


async def test_a_constrained_generation_resumes_its_grammar(pair):
    """JSON mode across a failover: the continuation names how many of its prompt tokens were generated under the
    grammar, so the new node's processor consumes them before it masks."""
    body = chat_body(max_tokens=MAX_TOKENS, temperature=0, response_format={"type": "json_object"})
    pair.decoders[0].mode, pair.decoders[0].break_after = "fail_mid_stream", 3
    status, _, out = await pair.chat(body)
    assert status == 200 and out["choices"][0]["message"]["content"] == REPLY
    first, cont = pair.decoders[0].requests[-1], pair.decoders[1].requests[-1]
    assert first["grammar"] == cont["grammar"] == {"type": "json_object"}
    assert first["grammar_generated"] == 0
    assert cont["grammar_generated"] == len(cont["token_ids"]) - len(first["token_ids"]) == 3
