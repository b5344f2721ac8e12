"""No harmony markup in content, ever (issue 22, item 7): gpt-oss outputs split by the gateway's OutputParser,
compared on well-formed outputs with the `openai_harmony` package's own parser (installed with vLLM; it carries the
o200k vocabulary) read as vLLM's chat serving reads it: analysis is reasoning, final and recipient-less commentary
are content, `functions.NAME` messages are calls whose arguments are the body as written (invalid JSON too), and
messages to built-in tools (python, browser) are dropped. Cut-off outputs leave no markup behind either."""

from __future__ import annotations

import json

import pytest

from tests.support.family_streams import char_chunks
from gateway.text.output import OutputParser

A = "<|start|>assistant"
OUTPUTS = {
    "answer": "<|channel|>analysis<|message|>Think.<|end|>" + A + "<|channel|>final<|message|>Paris.<|return|>",
    "call": "<|channel|>analysis<|message|>Need data.<|end|>" + A + "<|channel|>commentary to=functions.get_weather"
            " <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>",
    "invalid json": "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": Par<|call|>",
    "python": "<|channel|>analysis<|message|>Compute it.<|end|>" + A + "<|channel|>analysis to=python code"
              "<|message|>print(6 * 7)<|call|>",
    "browser": "<|channel|>analysis to=browser.search code<|message|>{\"query\": \"x\"}<|call|>",
    "preamble": "<|channel|>commentary<|message|>Checking.<|end|>" + A + " to=functions.get_weather<|channel|>"
                "commentary json<|message|>{}<|call|>",
}


@pytest.fixture(scope="module")
def harmony():
    import openai_harmony as oh
    enc = oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)

    def parse(text: str):
        """(reasoning, content, [(name, arguments)]) from openai_harmony's messages, split as vLLM does."""
        reasoning, content, calls = [], [], []
        for m in enc.parse_messages_from_completion_tokens(enc.encode(text, allowed_special="all"),
                                                          oh.Role.ASSISTANT):
            body = "".join(c.text for c in m.content)
            if m.recipient and m.recipient.startswith("functions."):
                calls.append((m.recipient[len("functions."):], body))
            elif m.channel == "analysis":
                reasoning.append(body)
            elif m.channel == "final" or (m.channel == "commentary" and not m.recipient):
                content.append(body)
        return "".join(reasoning), "".join(content), calls
    return parse


def split(text: str, size: int | None = None, stopped: bool = True):
    p = OutputParser("harmony", "harmony")
    parts = [p.feed(c) for c in (char_chunks(text, size) if size else [text])] + [p.finish(stopped)]
    reasoning = "".join(x.reasoning for x in parts)
    content = "".join(x.content for x in parts)
    calls = [c for x in parts for c in x.calls]
    return reasoning, content, calls, [x for part in parts for x in part.pieces]


@pytest.mark.parametrize("case", sorted(OUTPUTS))
def test_split_matches_openai_harmony(harmony, case):
    text = OUTPUTS[case]
    for size in (None, 1, 5):
        reasoning, content, calls, pieces = split(text, size)
        want_reasoning, want_content, want_calls = harmony(text)
        # vLLM's harmony serving drops a built-in tool's message; analysis sent to python is not reasoning either
        assert content == want_content and "<|" not in reasoning + content
        assert reasoning == want_reasoning or case in ("python", "browser")
        assert [(c.name, c.arguments) for c in calls] == want_calls
        for n, c in enumerate(calls):  # streamed: name first, fragments that join to the arguments
            mine = [x for x in pieces if x.call == n]
            assert mine[0].name == c.name and "".join(x.arguments for x in mine) == c.arguments


def test_invalid_json_is_passed_as_the_arguments_text(harmony):
    (call,) = split(OUTPUTS["invalid json"])[2]
    assert call.arguments == '{"city": Par'
    with pytest.raises(ValueError):
        json.loads(call.arguments)
    assert call.ollama() == {"function": {"name": "get_weather", "arguments": {}}}  # Ollama needs an object


@pytest.mark.parametrize("cut", ["<|channel|>analysis<|message|>Hmm<|end|><|start|>assistant<|channel|>fin",
                                 "<|channel|>commentary to=functions.get_weather <|constrain|>js",
                                 "<|channel|>final<|message|>Par",
                                 "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"a\""])
def test_cut_off_output_leaves_no_markup(cut):
    for size in (None, 1, 3):
        reasoning, content, calls, _ = split(cut, size, stopped=False)
        assert "<|" not in reasoning + content and "to=" not in content
    assert split(cut)[1] in ("", "Par")
