"""Issue 33's burst against a running site (`make site`): N requests at once on one model (default 3x its
max_inflight), alternating the `ollama` client (/api/generate, not streaming: the lab's app) and the OpenAI SDK
(streaming), counting answers and busy refusals; then, with --max-queued Q, the same burst through a second gateway
over the same nodes whose model queues at most Q (DISAGG_GATEWAY__QUEUE__MAX_QUEUED): past it, each API's busy answer
(Ollama 503, OpenAI 429, both with Retry-After).

    .venv/bin/python -m bench.bench_queue_burst --config examples/site-local.toml [--model smollm2:135m] [--n 12]
        [--max-queued 2] [--num-predict 16]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


async def burst(url: str, key: str | None, model: str, n: int, num_predict: int) -> list[tuple[str, str, float]]:
    """(client, outcome, seconds) per request: outcome "ok" or "HTTP <status> Retry-After <s>"."""
    import ollama
    import openai

    ol = ollama.AsyncClient(host=url, timeout=600, headers={"Authorization": f"Bearer {key}"} if key else None)
    sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key or "x", max_retries=0, timeout=600)

    async def via_ollama(i: int) -> tuple[str, str, float]:
        t0 = time.perf_counter()
        try:
            r = await ol.generate(model, f"Grade answer {i}: 2 + 2 = 4. Reply in one sentence.",
                                  options={"num_predict": num_predict, "temperature": 0.2})
            return "ollama", "ok" if r.done and r.eval_count > 0 else "empty", time.perf_counter() - t0
        except ollama.ResponseError as e:
            return "ollama", f"HTTP {e.status_code}", time.perf_counter() - t0

    async def via_openai(i: int) -> tuple[str, str, float]:
        t0 = time.perf_counter()
        try:
            stream = await sdk.chat.completions.create(
                model=model, max_tokens=num_predict, temperature=0.2, stream=True,
                messages=[{"role": "user", "content": f"Grade answer {i}: 2 + 2 = 4. Reply in one sentence."}])
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            return "openai-stream", "ok" if text else "empty", time.perf_counter() - t0
        except openai.APIStatusError as e:
            return ("openai-stream", f"HTTP {e.status_code} Retry-After {e.response.headers.get('retry-after')}",
                    time.perf_counter() - t0)

    try:
        return await asyncio.gather(*(via_ollama(i) if i % 2 == 0 else via_openai(i) for i in range(n)))
    finally:
        await sdk.close()


def report(title: str, rows: list[tuple[str, str, float]]) -> None:
    print(f"{title}: {sum(o == 'ok' for _, o, _ in rows)}/{len(rows)} answered")
    for client in ("ollama", "openai-stream"):
        outcomes: dict[str, int] = {}
        for c, o, _ in rows:
            if c == client:
                outcomes[o] = outcomes.get(o, 0) + 1
        print(f"  {client:<14} {outcomes}")
    print(f"  slowest {max(s for _, _, s in rows):.1f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "examples" / "site-local.toml")
    p.add_argument("--model")
    p.add_argument("--n", type=int, help="requests at once (default: 3x the model's max_inflight)")
    p.add_argument("--max-queued", type=int, help="also burst through a gateway whose model queues at most this")
    p.add_argument("--num-predict", type=int, default=16)
    p.add_argument("--smoke", action="store_true", help="smallest size, one rep (tests/bench/test_smoke.py)")
    args = p.parse_args()
    if args.smoke:
        args.n, args.num_predict, args.max_queued = 2, 2, 1
    from kv_bridge.config.settings import load_config

    s = load_config(args.config)
    route = s.route(args.model) if args.model else s.models[0]
    n = args.n or 3 * (route.max_inflight or 4)
    key = next(iter(s.auth.client_keys()), None)
    host = "127.0.0.1" if s.gateway.host in ("0.0.0.0", "") else s.gateway.host
    rows = asyncio.run(burst(f"http://{host}:{s.gateway.port}", key, route.id, n, args.num_predict))
    report(f"{n} at once on {route.id} (max_inflight {route.max_inflight}, max_queued {s.gateway.queue.max_queued})",
           rows)
    if args.max_queued is not None:
        from backends.site.second_gateway import SecondGateway

        log = Path(tempfile.gettempdir()) / "bench-queue-burst-gateway.log"
        with SecondGateway(args.config, log, env={"DISAGG_GATEWAY__QUEUE__MAX_QUEUED": str(args.max_queued)}) as gw:
            rows = asyncio.run(burst(gw.url, key, route.id, n, args.num_predict))
        report(f"{n} at once through a gateway with max_queued {args.max_queued}", rows)


if __name__ == "__main__":
    main()
