"""What the official clients send back in a tool loop reaches gpt-oss's chat template as the published template reads
it: OpenAI's `reasoning_content` / `reasoning` and Ollama's `thinking` as `message.thinking`, Ollama's `tool_name`,
null or empty history arguments. Without max_tokens a reasoning model gets the context's room, not 256 tokens.
References: transformers' apply_chat_template on the messages as the published template wants them."""

from __future__ import annotations

import json

import pytest

from tests.support.fakes import MODEL_ID, Cluster
from tests.support.family_streams import family_tokenizers
from tests.support.tiny_models import write_family_tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ANALYSIS = "Need the weather in Paris; call the tool."
FIRST = [{"role": "user", "content": "Weather in Paris?"}]
RESULT = "sunny, 21 C"


@pytest.fixture
async def gpt_oss(tmp_path, empty_config):
    folder = write_family_tokenizer(tmp_path / "gpt_oss", "gpt_oss")
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    c = await Cluster(n_prefill=0, model_dir=folder).start()
    c.decode.speak(folder, "<|channel|>final<|message|>Fine.")
    c.root = str(tmp_path / "ref")
    yield c
    await c.stop()


def reference_ids(c: Cluster, messages: list[dict], tools=TOOLS) -> list[int]:
    """The prompt ids transformers renders from the messages as the published gpt-oss template reads them."""
    hf, _ = family_tokenizers("gpt_oss", c.root)  # the same family tokenizer folder, template included
    return hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)


def sent_ids(c: Cluster) -> list[int]:
    return c.decode.requests[-1]["token_ids"]


def as_published(arguments) -> list[dict]:
    """The second step's history in the published template's terms: the analysis in `thinking`."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [*FIRST, {"role": "assistant", "content": "", "thinking": ANALYSIS, "tool_calls": [call]},
            {"role": "tool", "name": "get_weather", "content": RESULT}]


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
async def test_openai_reasoning_of_a_tool_call_turn_reaches_the_template(gpt_oss, field):
    import openai
    client = openai.AsyncOpenAI(base_url=gpt_oss.url + "/v1", api_key="unused")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turn = [*FIRST, {"role": "assistant", "content": None, field: ANALYSIS, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": RESULT}]
    await client.chat.completions.create(model=MODEL_ID, messages=turn, tools=TOOLS, max_tokens=8)
    assert sent_ids(gpt_oss) == reference_ids(gpt_oss, as_published({"city": "Paris"}))
    await client.close()


async def test_ollama_thinking_and_tool_name_reach_the_template(gpt_oss):
    import ollama
    oc = ollama.AsyncClient(host=gpt_oss.url)
    turn = [*FIRST, ollama.Message(role="assistant", content="", thinking=ANALYSIS, tool_calls=[
        ollama.Message.ToolCall(function=ollama.Message.ToolCall.Function(name="get_weather",
                                                                           arguments={"city": "Paris"}))]),
            ollama.Message(role="tool", tool_name="get_weather", content=RESULT)]
    await oc.chat(MODEL_ID, messages=turn, tools=TOOLS, options={"num_predict": 8})
    assert sent_ids(gpt_oss) == reference_ids(gpt_oss, as_published({"city": "Paris"}))


@pytest.mark.parametrize("arguments", [None, ""])
async def test_history_arguments_null_or_empty_are_no_arguments(gpt_oss, arguments):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    turn = [*FIRST, {"role": "assistant", "content": None, "reasoning_content": ANALYSIS, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": RESULT}]
    status, _, body = await gpt_oss.chat({"model": MODEL_ID, "messages": turn, "tools": TOOLS, "max_tokens": 8})
    assert status == 200, body
    assert sent_ids(gpt_oss) == reference_ids(gpt_oss, as_published({}))


@pytest.mark.parametrize("effort, rendered", [("minimal", "low"), ("none", "low"), ("high", "high")])
async def test_reasoning_effort_as_vllm_takes_it(gpt_oss, effort, rendered):
    """vLLM's reasoning_effort values; harmony cannot switch reasoning off, so "none" is its lowest effort."""
    status, _, body = await gpt_oss.chat({"model": MODEL_ID, "messages": FIRST, "max_tokens": 8,
                                          "reasoning_effort": effort})
    assert status == 200, body
    prompt = gpt_oss.decode.tok.decode(sent_ids(gpt_oss), skip_special_tokens=False)
    assert f"Reasoning: {rendered}\n" in prompt


async def test_without_max_tokens_a_long_analysis_still_answers(tmp_path, empty_config):
    """The SDK sends no max_tokens; gpt-oss reasons past 256 tokens and still answers, and `parse()` (which raises
    on finish_reason "length") reads the answer."""
    import openai
    folder = write_family_tokenizer(tmp_path / "gpt_oss", "gpt_oss")
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    c = await Cluster(n_prefill=0, model_dir=folder).start()
    analysis = " ".join(f"step {i}." for i in range(200))
    c.decode.speak(folder, f"<|channel|>analysis<|message|>{analysis}<|end|><|start|>assistant<|channel|>final"
                           "<|message|>Paris.")
    assert len(c.decode.reply_ids) > 300
    client = openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="unused")
    try:
        r = await client.chat.completions.parse(model=MODEL_ID, messages=FIRST)
        assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "Paris."
        assert r.usage.completion_tokens == len(c.decode.reply_ids)
    finally:
        await client.close()
        await c.stop()


async def test_parallel_calls_answer_null_content(tmp_path, empty_config):
    """qwen3-coder writes a newline between and after parallel calls; OpenAI's answer to a call-only turn has
    content null, and no stream delta carries that whitespace."""
    import openai
    folder = write_family_tokenizer(tmp_path / "qwen3_moe", "qwen3_moe")
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    c = await Cluster(n_prefill=0, model_dir=folder).start()
    c.decode.speak(folder, "".join(f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n"
                                   "</function>\n</tool_call>\n" for city in ("Paris", "Oslo")))
    client = openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="unused")
    try:
        r = await client.chat.completions.create(model=MODEL_ID, messages=FIRST, tools=TOOLS, max_tokens=200)
        msg = r.choices[0].message
        assert msg.content is None and [json.loads(t.function.arguments)["city"] for t in msg.tool_calls] == [
            "Paris", "Oslo"]
        stream = await client.chat.completions.create(model=MODEL_ID, messages=FIRST, tools=TOOLS, max_tokens=200,
                                                      stream=True)
        content, named = "", []
        async for ev in stream:
            for ch in ev.choices:
                content += ch.delta.content or ""
                named += [t.index for t in ch.delta.tool_calls or [] if t.function and t.function.name]
        assert (content, named) == ("", [0, 1])  # each call's name once, then its argument fragments
    finally:
        await client.close()
        await c.stop()


async def test_ollama_thinking_reaches_a_qwen3_template_as_reasoning_content(tmp_path, empty_config):
    """Qwen3's published template reads `reasoning_content`: Ollama's `thinking` of a tool-call turn gets there."""
    import ollama
    folder = write_family_tokenizer(tmp_path / "qwen3", "qwen3_moe", template="qwen3.jinja")
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    c = await Cluster(n_prefill=0, model_dir=folder).start()
    c.decode.speak(folder, "Fine.")
    try:
        call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        turn = [*FIRST, {"role": "assistant", "content": "", "thinking": ANALYSIS, "tool_calls": [call]},
                {"role": "tool", "tool_name": "get_weather", "content": RESULT}]
        # Raw JSON: the ollama package re-serializes tools (extra null fields), which the reference would not see.
        status, _, body = await c.post("/api/chat", {"model": MODEL_ID, "messages": turn, "tools": TOOLS,
                                                     "stream": False, "options": {"num_predict": 8}})
        assert status == 200 and ollama.ChatResponse.model_validate(body).done, body
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(folder))
        ref = [*FIRST, {"role": "assistant", "content": "", "reasoning_content": ANALYSIS, "tool_calls": [call]},
               {"role": "tool", "content": RESULT}]
        assert sent_ids(c) == hf.apply_chat_template(ref, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
        assert f"<think>\n{ANALYSIS}\n</think>" in hf.decode(sent_ids(c))
    finally:
        await c.stop()
