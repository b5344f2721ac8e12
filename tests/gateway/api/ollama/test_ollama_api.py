"""The Ollama API over real HTTP against fake nodes: model endpoints, generate/chat shapes, options -> sampling."""

from __future__ import annotations

import dataclasses
import json
import re
from datetime import datetime

from tests.support import oracle
from tests.support.fakes import MODEL_DIR, MODEL_ID, REPLY, Cluster
from kv_bridge.protocol import Sampling
from gateway.text.tokenizer import ChatTokenizer

TOK = ChatTokenizer.from_folder(MODEL_DIR)
REPLY_IDS = TOK.encode(REPLY)
FINAL_KEYS = {"model", "created_at", "done", "done_reason", "total_duration", "load_duration", "prompt_eval_count",
              "prompt_eval_duration", "eval_count", "eval_duration"}
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(Sampling)}


def chat_ids(*messages: tuple[str, str]) -> list[int]:
    return TOK.encode_chat([{"role": r, "content": c} for r, c in messages])


async def post(c: Cluster, path: str, body: dict) -> tuple[int, dict, dict]:
    async with c.http.post(f"{c.url}{path}", json=body) as r:
        status, got = r.status, await r.json(content_type=None)
    oracle.check(path, status, got)
    return status, dict(r.headers), got


async def ndjson(c: Cluster, path: str, body: dict) -> tuple[int, dict, list[dict]]:
    async with c.http.post(f"{c.url}{path}", json=body) as r:
        text = (await r.read()).decode()
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    for line in lines:
        oracle.check(path, r.status, line)
    return r.status, dict(r.headers), lines


def gen(prompt: str = "What is the capital of France?", **kw) -> dict:
    return {"model": MODEL_ID, "prompt": prompt, "stream": False, **kw}


def chat(text: str = "What is the capital of France?", **kw) -> dict:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": text}], "stream": False, **kw}


def assert_final(obj: dict, prompt_len: int, eval_count: int, reason: str = "stop") -> None:
    assert FINAL_KEYS <= set(obj), obj
    assert obj["done"] is True and obj["done_reason"] == reason
    assert obj["prompt_eval_count"] == prompt_len and obj["eval_count"] == eval_count
    for key in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(obj[key], int) and obj[key] >= 0, key
    assert obj["total_duration"] >= obj["prompt_eval_duration"] + obj["eval_duration"]
    assert obj["created_at"].endswith("Z") and datetime.fromisoformat(obj["created_at"].replace("Z", "+00:00"))


async def test_root_get_and_head(cluster):
    for method in ("GET", "HEAD"):
        async with cluster.http.request(method, f"{cluster.url}/") as r:
            assert r.status == 200
            assert (await r.text()) == ("Ollama is running" if method == "GET" else "")


async def test_version(cluster):
    async with cluster.http.get(f"{cluster.url}/api/version") as r:
        body = await r.json()
    assert r.status == 200 and re.fullmatch(r"\d+\.\d+\.\d+", body["version"])


async def test_tags(cluster):
    async with cluster.http.get(f"{cluster.url}/api/tags") as r:
        body = await r.json()
    assert r.status == 200
    (m,) = body["models"]
    assert m["name"] == m["model"] == MODEL_ID
    assert m["size"] == sum(p.stat().st_size for p in MODEL_DIR.rglob("*") if p.is_file() and p.name[0] != ".")
    assert re.fullmatch(r"[0-9a-f]{64}", m["digest"])
    datetime.fromisoformat(m["modified_at"].replace("Z", "+00:00"))
    d = m["details"]
    assert set(d) == {"format", "family", "families", "parameter_size", "quantization_level", "parent_model"}
    assert d["family"] == "llama" and d["families"] == ["llama"] and d["format"] == "safetensors"
    assert re.fullmatch(r"1[0-9]{2}(\.[0-9]+)?M", d["parameter_size"]) and d["quantization_level"] == "F32"


async def test_show(cluster):
    status, _, body = await post(cluster, "/api/show", {"model": MODEL_ID})
    assert status == 200, body
    assert {"modelfile", "parameters", "template", "details", "model_info", "capabilities"} <= set(body)
    assert body["capabilities"] == ["completion"]
    assert "<|im_start|>" in body["template"] and body["template"] in body["modelfile"]
    assert "num_ctx" in body["parameters"] and '"<|im_end|>"' in body["parameters"]
    info = body["model_info"]
    assert info["general.architecture"] == "llama" and info["general.parameter_count"] > 100_000_000
    assert info["llama.block_count"] == 30 and info["llama.attention.head_count_kv"] == 3
    assert info["llama.context_length"] == 8192 and info["llama.rope.freq_base"] == 100000.0
    legacy = await post(cluster, "/api/show", {"name": MODEL_ID})  # the pre-0.1 field name
    assert legacy[0] == 200 and legacy[2]["details"] == body["details"]


async def test_ps_lists_models_with_a_healthy_decode_node(cluster):
    async with cluster.http.get(f"{cluster.url}/api/ps") as r:
        (m,) = (await r.json())["models"]
    assert m["name"] == m["model"] == MODEL_ID and m["size_vram"] == 0 and m["context_length"] == 4096
    assert datetime.fromisoformat(m["expires_at"].replace("Z", "+00:00")) > datetime.now().astimezone()
    cluster.decode.down = True

    async def gone() -> bool:
        async with cluster.http.get(f"{cluster.url}/api/ps") as r:
            return (await r.json())["models"] == []
    await cluster.wait_for(gone)


async def test_generate_non_streaming(cluster):
    status, headers, body = await post(cluster, "/api/generate", gen())
    assert status == 200, body
    assert headers["Content-Type"].startswith("application/json")
    assert body["model"] == MODEL_ID and body["response"] == REPLY
    prompt = chat_ids(("user", "What is the capital of France?"))
    assert_final(body, len(prompt), len(REPLY_IDS))
    assert body["context"] == prompt + REPLY_IDS
    # The template's default system prompt makes this long enough (>= 32 tokens) to prefill on the prefill node.
    assert headers["x-disagg-path"] == "disaggregated" and headers["x-disagg-decode-node"] == "decode-0"
    assert headers["x-disagg-kv-tokens"] == str(len(prompt) - 1) and float(headers["x-disagg-prefill-ms"]) > 0
    assert cluster.prefill.requests[-1]["token_ids"] == prompt[:-1]
    sent = cluster.decode.requests[-1]
    assert sent["token_ids"] == prompt
    # Ollama's defaults, and no num_predict: generate until the context (max_model_len) is full.
    assert (sent["temperature"], sent["top_p"], sent["max_tokens"]) == (0.8, 0.9, 4096 - len(prompt))


async def test_generate_streaming_is_the_default(cluster):
    body = gen()
    del body["stream"]
    status, headers, lines = await ndjson(cluster, "/api/generate", body)
    assert status == 200 and headers["Content-Type"].startswith("application/x-ndjson")
    assert headers["x-disagg-decode-node"] == "decode-0"
    *chunks, last = lines
    assert all(set(c) == {"model", "created_at", "response", "done"} and c["done"] is False for c in chunks)
    assert "".join(c["response"] for c in chunks) == REPLY
    assert last["response"] == "" and last["context"][-len(REPLY_IDS):] == REPLY_IDS
    assert_final(last, len(chat_ids(("user", "What is the capital of France?"))), len(REPLY_IDS))


async def test_generate_system_raw_and_context(cluster):
    await post(cluster, "/api/generate", gen("hi", system="Be terse."))
    assert cluster.decode.requests[-1]["token_ids"] == chat_ids(("system", "Be terse."), ("user", "hi"))

    _, _, body = await post(cluster, "/api/generate", gen("<|im_start|>user\nhi", raw=True, system="ignored"))
    assert cluster.decode.requests[-1]["token_ids"] == TOK.encode("<|im_start|>user\nhi")
    assert "context" not in body  # as in Ollama: raw answers carry no context

    first = (await post(cluster, "/api/generate", gen("hi")))[2]["context"]
    await post(cluster, "/api/generate", gen("and again", context=first))
    assert cluster.decode.requests[-1]["token_ids"] == first + chat_ids(("user", "and again"))


async def test_chat_non_streaming(cluster):
    body = chat()
    body["messages"] = [{"role": "system", "content": "Answer briefly."}, *body["messages"]]
    status, headers, resp = await post(cluster, "/api/chat", body)
    assert status == 200, resp
    assert resp["message"] == {"role": "assistant", "content": REPLY} and "context" not in resp
    prompt = chat_ids(("system", "Answer briefly."), ("user", "What is the capital of France?"))
    assert cluster.decode.requests[-1]["token_ids"] == prompt
    assert_final(resp, len(prompt), len(REPLY_IDS))
    assert len(prompt) < 32 and headers["x-disagg-path"] == "local" and headers["x-disagg-kv-tokens"] == "0"


async def test_chat_streaming(cluster):
    status, _, lines = await ndjson(cluster, "/api/chat", chat(stream=True))
    assert status == 200
    *chunks, last = lines
    assert all(c["message"]["role"] == "assistant" and c["done"] is False for c in chunks)
    assert "".join(c["message"]["content"] for c in chunks) == REPLY
    assert last["message"] == {"role": "assistant", "content": ""}
    assert_final(last, len(chat_ids(("user", "What is the capital of France?"))), len(REPLY_IDS))


async def test_options_map_onto_sampling(cluster):
    opts = {"num_predict": 3, "temperature": 0.2, "top_p": 0.5, "seed": 7, "stop": ["\n", ""], "top_k": 5,
            "min_p": 0.05, "repeat_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.25,
            "mirostat": 2, "num_gpu": 99, "typical_p": 0.7}  # the last three are accepted and ignored
    status, _, body = await post(cluster, "/api/generate", gen(options=opts))
    assert status == 200, body
    assert body["done_reason"] == "length" and body["eval_count"] == 3
    assert body["response"] == cluster.decode.reply_text(3)
    sent = cluster.decode.requests[-1]
    assert (sent["max_tokens"], sent["temperature"], sent["top_p"], sent["seed"], sent["stop"]) == (
        3, 0.2, 0.5, 7, ["\n"])
    extras = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.25}
    for name, value in extras.items():  # passed on only where the decode protocol has the field
        assert sent.get(name) == (value if name in SAMPLING_FIELDS else None), name
    assert "mirostat" not in sent and "repeat_penalty" not in sent


async def test_option_edge_cases(cluster):
    await post(cluster, "/api/chat", chat(options={"stop": "Paris", "seed": -1, "top_p": 0, "top_k": 0}))
    sent = cluster.decode.requests[-1]
    assert sent["stop"] == ["Paris"] and sent["seed"] is None  # a negative seed is Ollama's "random"
    assert (sent["temperature"], sent["top_p"]) == (0.0, 1.0)  # top_p 0 keeps only the best token: greedy
    if "top_k" in SAMPLING_FIELDS:
        assert sent["top_k"] == 0
    await post(cluster, "/api/chat", chat(options={"num_predict": -2}))
    assert cluster.decode.requests[-1]["max_tokens"] == 4096 - len(chat_ids(("user", "What is the capital of France?")))


async def test_num_ctx_is_clamped_and_budgeted(cluster):
    n = len(chat_ids(("user", "What is the capital of France?")))
    await post(cluster, "/api/chat", chat(options={"num_ctx": 100_000}))
    assert cluster.decode.requests[-1]["max_tokens"] == 4096 - n  # clamped to the model's max_model_len
    await post(cluster, "/api/chat", chat(options={"num_ctx": n + 5}))
    assert cluster.decode.requests[-1]["max_tokens"] == 5
    status, _, body = await post(cluster, "/api/chat", chat(options={"num_ctx": n + 5, "num_predict": 6}))
    assert status == 400 and "num_predict" in body["error"]
    status, _, body = await post(cluster, "/api/generate", gen(options={"num_ctx": n}))
    assert status == 400 and "context window" in body["error"]
    status, _, body = await post(cluster, "/api/generate", gen(options={"num_predict": 5000}))
    assert status == 400 and "4096" in body["error"]


async def test_empty_prompt_loads_the_model(cluster):
    for body in ({"model": MODEL_ID}, {"model": MODEL_ID, "prompt": "", "stream": True}):
        status, _, resp = await post(cluster, "/api/generate", body)
        assert status == 200, resp
        assert resp == {"model": MODEL_ID, "created_at": resp["created_at"], "response": "", "done": True,
                        "done_reason": "load"}
    _, _, resp = await post(cluster, "/api/generate", {"model": MODEL_ID, "keep_alive": 0})
    assert resp["done_reason"] == "unload"
    _, _, resp = await post(cluster, "/api/chat", {"model": MODEL_ID, "messages": [], "keep_alive": "0s"})
    assert resp["message"] == {"role": "assistant", "content": ""} and resp["done_reason"] == "unload"
    _, _, resp = await post(cluster, "/api/chat", {"model": MODEL_ID})
    assert resp["done"] is True and resp["done_reason"] == "load"
    assert cluster.decode.requests == []  # nothing was generated
