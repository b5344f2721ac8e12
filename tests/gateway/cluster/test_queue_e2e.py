"""Issue 33's burst on the real stack: 3x a model's max_inflight at once, through the `ollama` client (the lab's app:
/api/generate, not streaming) and the OpenAI SDK (streaming): every request answered, none refused, the extra ones
having waited in the gateway's queue. A second gateway over the session stack's nodes, its model's max_inflight 2
(the session gateway has none, and restarting it would cost the other tests)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys

import aiohttp
import pytest

from tests.support.fakes import sample_value
from tests.support.stack import MODEL_ID, ROOT, free_port, terminate, wait_http

pytestmark = pytest.mark.e2e
MAX_INFLIGHT = 2


@pytest.fixture(scope="module")
def narrow_gateway(stack, tmp_path_factory):
    """The session stack's config with another gateway port and `max_inflight = 2` on the model."""
    folder = tmp_path_factory.mktemp("queue")
    port = free_port()
    text = stack.config.read_text()
    text = re.sub(r"(\[gateway\]\nport = )\d+", rf"\g<1>{port}", text)
    text = text.replace("[[models]]\n", f"[[models]]\nmax_inflight = {MAX_INFLIGHT}\n")
    config = folder / "config.toml"
    config.write_text(text)
    with open(folder / "gateway.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "backends.cli.main", "gateway", "--config", str(config)], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **stack.env})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", 120, proc)
        yield url, folder / "gateway.log"
    finally:
        terminate(proc, 10)


async def _metric(url: str, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        value = sample_value(await r.text(), name, **labels)
    return 0.0 if value is None else value


async def test_a_burst_of_three_times_max_inflight_is_queued_and_answered_not_refused(narrow_gateway):
    import ollama
    import openai

    url, log = narrow_gateway
    n = 3 * MAX_INFLIGHT
    ol = ollama.AsyncClient(host=url, timeout=300)
    sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)

    async def via_ollama(i: int) -> str:
        r = await ol.generate(MODEL_ID, f"Say the number {i}.", options={"num_predict": 6, "temperature": 0})
        assert r.done and r.eval_count > 0
        return r.response

    async def via_openai(i: int) -> str:
        stream = await sdk.chat.completions.create(model=MODEL_ID, max_tokens=6, temperature=0, stream=True,
                                                   messages=[{"role": "user", "content": f"Say the number {i}."}])
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    try:
        answers = await asyncio.gather(*(via_ollama(i) if i % 2 else via_openai(i) for i in range(n)),
                                       return_exceptions=True)
    finally:
        await sdk.close()
    errors = [a for a in answers if isinstance(a, BaseException)]
    assert not errors, (errors, log.read_text(errors="replace")[-3000:])
    assert all(isinstance(a, str) and a for a in answers), answers
    # 6 at once against 2 slots: at least 4 waited in the gateway's queue, and nothing was refused.
    assert await _metric(url, "disagg_queue_wait_seconds_count", model=MODEL_ID) >= n - MAX_INFLIGHT
    assert await _metric(url, "disagg_queue_refused_total", model=MODEL_ID, reason="full") == 0
    assert await _metric(url, "disagg_queue_refused_total", model=MODEL_ID, reason="wait") == 0
    assert await _metric(url, "disagg_queue_length", model=MODEL_ID) == 0
    for status in ("4xx", "5xx"):
        for path in ("none", "disaggregated", "local", "fallback"):
            assert await _metric(url, "disagg_requests_total", model=MODEL_ID, path=path, status=status) == 0
