"""gateway/text/reasoning.py on real token sequences of the families' formats (harmony for gpt_oss, <think> for Qwen3):
streamed token by token as the decode node streams them, and in arbitrary text chunks as an upstream sends them."""

from __future__ import annotations

import pytest

from tests.support.family_streams import char_chunks, family_tokenizers, run, token_stream
from gateway.text.reasoning import HarmonyParser, ThinkParser, reasoning_parser, template_kwargs

ANALYSIS_FINAL = ("<|channel|>analysis<|message|>The user wants the capital. It is Paris.<|end|>"
                  "<|start|>assistant<|channel|>final<|message|>The capital of France is **Paris**.<|return|>")
TOOL_CALL = ("<|channel|>analysis<|message|>Need weather; call the tool.<|end|>"
             "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
             "<|message|>{\"city\": \"Paris\", \"unit\": \"celsius\"}<|call|>")
PREAMBLE = ("<|channel|>commentary<|message|>Checking the weather now.<|end|>"
            "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
            "<|message|>{\"city\": \"Oslo\"}<|call|>")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("family"))


def _both_paths(family, root, text, parser_factory):
    """The parse of the decode node's token stream, checked equal to the parse at several text chunkings."""
    ids, chunks = token_stream(family, root, text)
    got = run(parser_factory(), chunks)
    for size in (1, 2, 5, 17, len(text)):
        again = run(parser_factory(), char_chunks(text, size))
        # A call's body streams in pieces as its chunks came; the pieces join to the same text.
        assert (again.reasoning, again.content, again.messages) == (got.reasoning, got.content, got.messages)
        assert _joined(again.pieces) == _joined(got.pieces)
    return ids, got


def _joined(pieces):
    out: dict = {}
    for n, recipient, text in pieces:
        out[(n, recipient)] = out.get((n, recipient), "") + text
    return out


def test_harmony_special_tokens_are_single_ids_and_in_the_streamed_text(root):
    hf, _ = family_tokenizers("gpt_oss", root)
    ids, chunks = token_stream("gpt_oss", root, ANALYSIS_FINAL)
    for marker in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|return|>"):
        (tid,) = hf.encode(marker, add_special_tokens=False)
        assert tid in ids and marker in chunks  # one token, whose text is the marker itself


def test_harmony_analysis_is_reasoning_final_is_content(root):
    _, d = _both_paths("gpt_oss", root, ANALYSIS_FINAL, HarmonyParser)
    assert d.reasoning == "The user wants the capital. It is Paris."
    assert d.content == "The capital of France is **Paris**."
    assert d.messages == []


def test_harmony_streams_each_part_as_it_arrives(root):
    _, chunks = token_stream("gpt_oss", root, ANALYSIS_FINAL)
    p = HarmonyParser()
    seen = [p.feed(c) for c in chunks]
    first_content = next(i for i, d in enumerate(seen) if d.content)
    last_reasoning = max(i for i, d in enumerate(seen) if d.reasoning)
    assert last_reasoning < first_content < len(chunks) - 3  # content streams, not held to the end


def test_harmony_tool_call_message(root):
    _, d = _both_paths("gpt_oss", root, TOOL_CALL, HarmonyParser)
    assert d.reasoning == "Need weather; call the tool."
    (m,) = d.messages
    assert (m.recipient, m.channel, m.content_type) == ("functions.get_weather", "commentary", "json")
    assert m.body == '{"city": "Paris", "unit": "celsius"}'


def test_harmony_preamble_and_recipient_before_channel(root):
    _, d = _both_paths("gpt_oss", root, PREAMBLE, HarmonyParser)
    assert d.content == "Checking the weather now."
    assert [m.recipient for m in d.messages] == ["functions.get_weather"]


def test_harmony_cut_off_and_plain_text(root):
    d = run(HarmonyParser(), ["<|channel|>final<|message|>Par"])  # max_tokens hit mid-answer
    assert (d.reasoning, d.content) == ("", "Par")
    d = run(HarmonyParser(), ["<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": "])
    assert d.content == "" and [m.body for m in d.messages] == ['{"a": ']  # a call cut off still ends
    assert run(HarmonyParser(), ["just text"]).content == "just text"


def test_think_block_split(root):
    text = "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"
    _, d = _both_paths("qwen3_moe", root, text, ThinkParser)
    assert d.reasoning.strip() == "The user greets me."
    assert d.content.strip() == "Hello! How can I help?"


def test_think_started_by_the_prompt_and_no_think(root):
    _, d = _both_paths("qwen3_moe", root, "plan it</think>done", lambda: ThinkParser(start_in_reasoning=True))
    assert (d.reasoning, d.content) == ("plan it", "done")
    _, d = _both_paths("qwen3_moe", root, "no thinking here, <think> is a word", ThinkParser)
    assert (d.reasoning, d.content) == ("", "no thinking here, <think> is a word")


def test_registry():
    assert isinstance(reasoning_parser("harmony"), HarmonyParser)
    assert reasoning_parser("think", start_in_reasoning=True).thinking
    with pytest.raises(ValueError, match="known: harmony, think"):
        reasoning_parser("deepseek")


def test_template_kwargs_from_think_and_reasoning_effort():
    assert template_kwargs("harmony", reasoning_effort="high") == {"reasoning_effort": "high"}
    assert template_kwargs("harmony", think="low") == {"reasoning_effort": "low"}
    assert template_kwargs("harmony", think=True) == {}  # the template's default effort (medium)
    assert template_kwargs("harmony", think=False) == {"reasoning_effort": "low"}
    assert template_kwargs("think", think=False) == {"enable_thinking": False}
    assert template_kwargs("think", think="high") == {"enable_thinking": True}
    assert template_kwargs("think") == {} and template_kwargs("", think=True) == {}
    with pytest.raises(ValueError, match="low, medium, high"):
        template_kwargs("harmony", reasoning_effort="max")
