"""Details Ollama's clients read: /api/show `capabilities` (VS Code offers tools only when "tools" is listed),
tool calls with `id` and `function.index`, `think: "max"`. Bodies are read with the `ollama` package's types."""

from __future__ import annotations

import json

import pytest

from tests.support.fakes import MODEL_ID, Cluster
from tests.support.tiny_models import write_family_tokenizer

import ollama

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TWO_CALLS = "".join(f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n</function>\n"
                    "</tool_call>\n" for city in ("Paris", "Oslo"))


async def _cluster(tmp_path, family: str | None, reply: str = "Fine.") -> Cluster:
    if family is None:  # the embedded SmolLM2: its template renders no tools, and it does not reason
        return await Cluster(n_prefill=0).start()
    folder = write_family_tokenizer(tmp_path / family, family)
    (folder / "config.json").write_text(json.dumps({"model_type": family}))
    c = await Cluster(n_prefill=0, model_dir=folder).start()
    c.decode.speak(folder, reply)
    return c


@pytest.mark.parametrize("family, expected", [
    ("gpt_oss", ["completion", "tools", "thinking"]),
    ("qwen3_moe", ["completion", "tools"]),  # qwen3-coder: tools, no reasoning
    (None, ["completion"]),
])
async def test_show_lists_capabilities(tmp_path, empty_config, family, expected):
    c = await _cluster(tmp_path, family)
    try:
        r = await ollama.AsyncClient(host=c.url).show(MODEL_ID)
        assert r.capabilities == expected
    finally:
        await c.stop()


async def test_parallel_tool_calls_carry_id_and_index(tmp_path, empty_config):
    c = await _cluster(tmp_path, "qwen3_moe", TWO_CALLS)
    try:
        msgs = [{"role": "user", "content": "Weather in Paris and Oslo?"}]
        status, _, body = await c.post("/api/chat", {"model": MODEL_ID, "messages": msgs, "tools": TOOLS,
                                                     "stream": False, "options": {"num_predict": 200}})
        assert status == 200, body
        calls = ollama.ChatResponse.model_validate(body).message.tool_calls
        assert [(t.function.name, dict(t.function.arguments)) for t in calls] == [
            ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
        raw = body["message"]["tool_calls"]  # the package's types drop id and index; the wire carries them
        assert [t["function"]["index"] for t in raw] == [0, 1]
        assert all(t["id"] for t in raw) and raw[0]["id"] != raw[1]["id"]

        async with c.http.post(f"{c.url}/api/chat", json={"model": MODEL_ID, "messages": msgs, "tools": TOOLS,
                                                          "options": {"num_predict": 200}}) as r:
            lines = [json.loads(line) for line in (await r.read()).splitlines() if line.strip()]
        streamed = [t for line in lines for t in line["message"].get("tool_calls") or []]
        assert [t["function"]["index"] for t in streamed] == [0, 1] and all(t["id"] for t in streamed)
    finally:
        await c.stop()


async def test_think_max_is_the_highest_effort(tmp_path, empty_config):
    c = await _cluster(tmp_path, "gpt_oss", "<|channel|>final<|message|>Fine.")
    try:
        r = await ollama.AsyncClient(host=c.url).chat(MODEL_ID, messages=[{"role": "user", "content": "hi"}],
                                                       think="max", options={"num_predict": 8})
        assert r.message.content == "Fine."
        prompt = c.decode.tok.decode(c.decode.requests[-1]["token_ids"], skip_special_tokens=False)
        assert "Reasoning: high\n" in prompt
    finally:
        await c.stop()
