"""Render tests of the families' chat templates (tests/support/templates, on the family tokenizers): harmony's system and
developer messages, reasoning effort, tools, tool calls and results; qwen3-coder's XML tools and calls; Qwen3's
<think> switch. Rendered with transformers' own apply_chat_template."""

from __future__ import annotations

import pytest

from tests.support.family_streams import family_tokenizers
from tests.support.tiny_models import TEMPLATES_DIR, build_family

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "City name"}, "unit": {"enum": ["c", "f"]}}}}}]
CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "thinking": "Use the tool.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "{\"temp\": 4}"}]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("family"))


def render(root, family, template, messages, **kw) -> str:
    hf, _ = family_tokenizers(family, root)
    return hf.apply_chat_template(messages, chat_template=(TEMPLATES_DIR / template).read_text(), tokenize=False,
                                  **kw)


def test_harmony_system_developer_and_effort(root):
    text = render(root, "gpt_oss", "gpt_oss.jinja", CHAT[:2], add_generation_prompt=True, reasoning_effort="high")
    assert text.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "Reasoning: high\n\n# Valid channels: analysis, commentary, final." in text
    assert "<|start|>developer<|message|># Instructions\n\nAnswer briefly.<|end|>" in text
    assert text.endswith("<|start|>user<|message|>Weather in Oslo?<|end|><|start|>assistant")
    assert "Reasoning: medium" in render(root, "gpt_oss", "gpt_oss.jinja", CHAT[1:2], add_generation_prompt=True)
    assert "<|start|>developer" not in render(root, "gpt_oss", "gpt_oss.jinja", CHAT[1:2])


def test_harmony_tools_calls_and_results(root):
    text = render(root, "gpt_oss", "gpt_oss.jinja", CHAT, tools=TOOLS, add_generation_prompt=True)
    assert "Calls to these tools must go to the commentary channel: 'functions'." in text
    assert ("# Tools\n\n## functions\n\nnamespace functions {\n\n// Current weather\ntype get_weather = (_: {\n"
            "// City name\ncity: string,\nunit?: \"c\" | \"f\",\n}) => any;\n\n} // namespace functions<|end|>") in text
    assert ("<|start|>assistant<|channel|>analysis<|message|>Use the tool.<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
            "<|message|>{\"city\": \"Oslo\"}<|call|>"
            "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\"{\\\"temp\\\": 4}\"<|end|>"
            "<|start|>assistant") in text


def test_harmony_earlier_final_turns_drop_their_analysis(root):
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "thinking": "think"},
            {"role": "user", "content": "c"}]
    text = render(root, "gpt_oss", "gpt_oss.jinja", chat, add_generation_prompt=True)
    assert "think" not in text and "<|start|>assistant<|channel|>final<|message|>b<|end|>" in text


def test_harmony_reads_the_analysis_where_the_published_template_does(root):
    """As openai/gpt-oss-120b's chat template: the analysis is `thinking` (`reasoning_content` is not read; the
    gateway maps it), a tool-call turn keeps it until a later final answer, and without thinking the tool-call
    turn's content is its analysis."""
    analysis = "<|start|>assistant<|channel|>analysis<|message|>Use the tool.<|end|>"
    assert analysis in render(root, "gpt_oss", "gpt_oss.jinja", CHAT, add_generation_prompt=True)
    as_vllm = [*CHAT[:2], {**CHAT[2], "thinking": None, "reasoning_content": "Use the tool."}, CHAT[3]]
    assert analysis not in render(root, "gpt_oss", "gpt_oss.jinja", as_vllm, add_generation_prompt=True)
    in_content = [*CHAT[:2], {**CHAT[2], "thinking": None, "content": "Use the tool."}, CHAT[3]]
    assert analysis in render(root, "gpt_oss", "gpt_oss.jinja", in_content, add_generation_prompt=True)
    answered = [*CHAT, {"role": "assistant", "content": "4 C."}, {"role": "user", "content": "Thanks"}]
    assert "Use the tool." not in render(root, "gpt_oss", "gpt_oss.jinja", answered, add_generation_prompt=True)


def test_qwen3_coder_tools_calls_and_responses(root):
    text = render(root, "qwen3_moe", "qwen3_coder.jinja", CHAT, tools=TOOLS, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nAnswer briefly.\n\n# Tools\n\nYou have access to the following")
    assert "<function>\n<name>get_weather</name>\n<description>Current weather</description>" in text
    assert "<parameter>\n<name>city</name>\n<type>string</type>\n<description>City name</description>" in text
    assert ("<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
            "</function>\n</tool_call><|im_end|>\n") in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n{\"temp\": 4}\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")


def test_qwen3_hermes_calls_and_thinking_switch(root):
    text = render(root, "qwen3_moe", "qwen3.jinja", CHAT, tools=TOOLS, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>' in text
    off = render(root, "qwen3_moe", "qwen3.jinja", CHAT[1:2], add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    on = render(root, "qwen3_moe", "qwen3.jinja", CHAT[1:2], add_generation_prompt=True, enable_thinking=True)
    assert on.endswith("<|im_start|>assistant\n")


def test_tiny_gpt_oss_speaks_harmony(tmp_path):
    """The tiny gpt_oss checkpoint with its family tokenizer loads in mlx-lm and its template renders harmony."""
    from mlx_lm import load

    folder = build_family("gpt_oss", tmp_path / "gpt_oss")
    model, tok = load(str(folder))
    prompt = tok.apply_chat_template(CHAT[1:2], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|start|>assistant")
    assert tok.convert_tokens_to_ids("<|return|>") in tok.eos_token_ids


def test_qwen3_tool_loop_keeps_reasoning_after_the_last_query(root):
    """As the published Qwen3 templates: an assistant turn after the last user query carries its
    `reasoning_content` in a <think> block (a tool loop); one before it drops it."""
    loop = [CHAT[1], {**CHAT[2], "thinking": None, "reasoning_content": "Use the tool."}, CHAT[3]]
    text = render(root, "qwen3_moe", "qwen3.jinja", loop, tools=TOOLS, add_generation_prompt=True)
    assert "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n<tool_call>\n" in text
    later = [*loop, {"role": "assistant", "content": "4 C."}, {"role": "user", "content": "Thanks"}]
    assert "Use the tool." not in render(root, "qwen3_moe", "qwen3.jinja", later, tools=TOOLS,
                                         add_generation_prompt=True)
