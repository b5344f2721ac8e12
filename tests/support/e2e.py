"""What the e2e modules share on the real stack: an HTTP call checked by the oracle, a chat on the session stack, the
prompt's ids as transformers templates them, and the MLX-alone references (a greedy answer, a one-shot prefill's KV
of TEXT, conftest's `text_kv`)."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

import numpy as np

from tests.support import oracle
from tests.support.stack import MODEL_ID

MAX_TOKENS = 24


def post(url: str, body: dict | bytes, timeout: float = 300,
         headers: dict | None = None) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, headers, got = r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        status, headers, got = e.code, dict(e.headers), json.loads(e.read())
    oracle.check(urllib.parse.urlsplit(url).path, status, got)
    return status, headers, got


def chat(stack, content: str, **extra) -> tuple[int, dict, dict]:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0, **extra}
    return post(stack.url("gateway") + "/v1/chat/completions", body)


def prompt_ids(hf_tokenizer, content: str) -> list[int]:
    text = hf_tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=False)
    return hf_tokenizer.encode(text, add_special_tokens=False)


def mlx_alone(mlx_ref, ids: list[int]) -> str:
    from mlx_lm import generate

    model, tok = mlx_ref
    return generate(model, tok, prompt=ids, max_tokens=MAX_TOKENS)


TEXT = ("The quick brown fox jumps over the lazy dog while the committee debates the annual budget "
        "for rivers, mountains and the history of early computing machines. ") * 40


def mlx_kv(model, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """MLX's own prefill of `ids`: (L, H, T, D) keys and values."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kv_bridge.mlx.cache import cache_kv

    cache = make_prompt_cache(model)
    model(mx.array(ids)[None], cache=cache)
    return cache_kv(cache, len(ids))
