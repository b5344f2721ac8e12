"""`disagg smoke`: from any machine, one prompt per model long enough for the disaggregated path, sent through the
running gateway as the lab's app sends it (Ollama /api/chat): the path it took, TTFT, KV tokens and bytes, prefill and
transfer time, the pair's KV fidelity verdict and decode tokens/s; when it did not take the split, why and the remedy
(read from the answer and the gateway's /health after it: nodes, per-pair KV fidelity verdicts)."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field

import aiohttp

from backends.cli.status import API_KEY_ENV, ClientKey, client_key
from kv_bridge.config.models import ModelRoute
from kv_bridge.config.settings import Settings
from kv_bridge.config.source import ConfigError

MIN_PROMPT_TOKENS = 512  # a floor whatever min_disagg_tokens says: enough KV that its bytes and transfer show
# Words the prompt's notes are made of: varied, so its tokens are ordinary text and not one repeated run.
_WORDS = ("river", "ledger", "granite", "harbor", "lantern", "orchard", "meridian", "quarry", "signal", "thicket",
          "compass", "bellows", "cistern", "falcon", "gazette", "hollow", "juniper", "kestrel", "mosaic", "nettle")


@dataclass
class Smoke:
    """One model's smoke request and what it showed; `causes`: (cause, remedy), empty when it took the split."""

    model: str
    ok: bool = False
    status: int | None = None  # the gateway's HTTP status
    path: str | None = None  # x-disagg-path
    decode_node: str | None = None
    prompt_tokens: int = 0
    kv_tokens: int = 0  # prompt tokens whose KV crossed from the prefill node
    prefix_tokens: int = 0  # prompt tokens the decode node held already (the chat template's head: a cached prefix)
    kv_bytes: int | None = None
    ttft_s: float | None = None  # the gateway's, request arrival to first token (Ollama's load + prompt_eval)
    prefill_s: float | None = None  # the prefill call, KV streamed out while it computes
    kv_transfer_s: float | None = None  # the decode node's, header to last frame
    decode_tokens: int = 0
    decode_tokens_per_s: float | None = None
    fallbacks: list[str] = field(default_factory=list)
    predicted_ttft_ms: float | None = None
    fidelity: list[dict] = field(default_factory=list)  # the model's /health fidelity rows (the decode node's pairs)
    error: str | None = None
    causes: list[tuple[str, str]] = field(default_factory=list)
    notes: list[tuple[str, str]] = field(default_factory=list)  # (finding, remedy) that did not stop the split


def target_tokens(route: ModelRoute, tokens: int | None, max_tokens: int) -> int:
    """Prompt tokens to send: twice the model's min_disagg_tokens (at least MIN_PROMPT_TOKENS), or --tokens; within
    max_model_len with room for the answer."""
    room = route.max_model_len - max_tokens - 16
    want = tokens or max(2 * route.min_disagg_tokens, MIN_PROMPT_TOKENS)
    if want <= route.min_disagg_tokens:
        raise ConfigError(f"smoke: --tokens {want} is not above {route.id}'s min_disagg_tokens "
                          f"{route.min_disagg_tokens}: such a prompt prefills on the decode node by design")
    if route.min_disagg_tokens >= room:
        raise ConfigError(f"smoke: {route.id}'s min_disagg_tokens {route.min_disagg_tokens} leaves no prompt within "
                          f"max_model_len {route.max_model_len}: no request of it can take the disaggregated path")
    return min(want, room)


def prompt_text(notes: int, nonce: str) -> str:
    """A grading-like prompt: an instruction, then numbered notes. The nonce leads, so no decode node holds any of it
    as a cached prefix and all of its KV crosses the link."""
    lines = [f"Smoke test {nonce}. Read the numbered notes, then answer in one short sentence: which note is last?"]
    for i in range(notes):
        a, b, c = (_WORDS[(i * k + j) % len(_WORDS)] for k, j in ((1, 0), (3, 7), (7, 3)))
        lines.append(f"Note {i + 1}: the {a} by the {b} keeps {i % 9 + 2} {c}s.")
    return "\n".join(lines)


# ---- why not: the answer and the gateway's /health after it, each cause with its remedy ----

FIDELITY_DOC = 'docs/kv_bridge.md, "The fidelity canary" and "Lifecycle"'


def diagnose(smoke: Smoke, route: ModelRoute, health: dict | None, key: ClientKey, config: str, url: str) -> None:
    """Set `smoke.ok`, `smoke.fidelity` (the decode node's pairs, every pair of the model when none is known) and
    `smoke.causes`."""
    nodes = {n["name"]: n for n in (health or {}).get("nodes", [])}
    rows = [r for r in (health or {}).get("fidelity", []) if r.get("model") == route.id]
    smoke.fidelity = [r for r in rows if r["decode"] == smoke.decode_node] or rows
    smoke.ok = smoke.error is None and smoke.path == "disaggregated" and smoke.kv_tokens > 0
    if smoke.ok:
        smoke.notes = _down(route, nodes, config)  # another node of the model: this request did not need it
        return
    if smoke.error is not None:
        smoke.causes += _refused(smoke, key, config, url)
    elif smoke.path == "disaggregated":  # every token's KV was already on the decode node: nothing crossed
        smoke.causes.append((f"{smoke.decode_node} held this prompt's KV already (its prefix cache): none crossed",
                             "run the smoke again: each run's prompt is new"))
    elif smoke.path == "fallback":
        smoke.causes.append((f"the prefill or its KV failed ({', '.join(smoke.fallbacks) or 'no reason given'}): "
                             f"{smoke.decode_node} prefilled the prompt itself",
                             f"`disagg status --config {config}` probes each prefill -> decode link and runs the "
                             f"canary; the logs of {smoke.decode_node} and of the prefill nodes name the error"))
    elif smoke.path == "upstream":
        smoke.causes.append(("no decode node could serve it: it went to the model's upstream",
                             "bring a decode node of the model up (below)"))
    if health is None and smoke.error is None:
        smoke.causes.append((f"the gateway's /health did not answer at {url}", _doctor(config, "gateway")))
    smoke.causes += _down(route, nodes, config)
    if smoke.path == "local":
        smoke.causes += _why_local(smoke, route, nodes, rows, config)


def _doctor(config: str, node: str) -> str:
    where = "the gateway box" if node == "gateway" else node
    return f"on {where}: `disagg doctor --config {config} --node {node}`, then that service's log"


def _refused(smoke: Smoke, key: ClientKey, config: str, url: str) -> list[tuple[str, str]]:
    if smoke.status is None:
        return [(f"no answer from the gateway at {url}: {smoke.error}",
                 f"{_doctor(config, 'gateway')}; from another machine, --url the address it listens on")]
    if smoke.status == 401:
        why = key.missing or f"it refused the key from {key.source}"
        return [(f"the gateway wants a client key: {why}",
                 f"pass --key KEY or set {API_KEY_ENV} (one line of the gateway box's api-keys file)")]
    if smoke.status == 404:
        return [(smoke.error, f"the running gateway does not serve {smoke.model}: restart it with {config}, or "
                 f"--model one it lists at {url}/v1/models")]
    if smoke.status == 503:
        return [(smoke.error, "no decode node of the model can take it now: each one down is below; else it is "
                 "full (retry)")]
    return [(smoke.error, "the gateway's log has the request's error")]


def _down(route: ModelRoute, nodes: dict, config: str) -> list[tuple[str, str]]:
    out = []
    for name in [*route.prefill, *route.decode]:
        n = nodes.get(name)
        if n is not None and not n.get("up"):
            role = "prefill" if name in route.prefill else "decode"
            out.append((f"{role} node {name} is down: {n.get('reason') or 'no reason given'}", _doctor(config, name)))
    return out


def _why_local(smoke: Smoke, route: ModelRoute, nodes: dict, rows: list[dict], config: str) -> list[tuple[str, str]]:
    """A local answer: no prefill node, none up, no usable pair (the canary's verdict), or the gateway's pricing."""
    if not route.prefill:
        return [(f"{route.id} names no prefill node ([[models]] prefill = [])",
                 f"list its prefill nodes in {config} and restart the gateway")]
    up = [p for p in route.prefill if nodes.get(p, {}).get("up")]
    if not up:
        return []  # each down node is a cause already
    pairs = [r for r in rows if r["decode"] == smoke.decode_node and r["prefill"] in up]
    unusable = [r for r in pairs if not r.get("usable", True)]
    if pairs and len(unusable) == len(pairs):
        return [_verdict_cause(r, config) for r in unusable]
    predicted = "" if smoke.predicted_ttft_ms is None else f" (predicted TTFT {smoke.predicted_ttft_ms:.0f} ms)"
    return [(f"the gateway priced local prefill on {smoke.decode_node} sooner{predicted} than prefill on "
             f"{', '.join(up)}, whose pairs it may use",
             f"the gateway's /health `rates` shows what it learned of each prefill node and link (a slow one is "
             f"priced out); `disagg status --config {config}` measures the links; --tokens N sends a longer prompt")]


def _verdict_cause(row: dict, config: str) -> tuple[str, str]:
    """A pair the gateway will not send KV over, from its /health fidelity row."""
    pair = f"{row['model']} {row['prefill']} -> {row['decode']}"
    state, summary, ov = row.get("state"), row.get("summary") or row.get("state"), row.get("override")
    if ov is not None and not ov.get("usable"):
        return (f"{pair} is ruled out by a [[fidelity.override]]: {ov.get('reason')}",
                f"remove that override from {config} (and restart the gateway) once its reason no longer holds")
    if state == "failed":
        return (f"KV fidelity of {pair} FAILED: {summary.removeprefix('failed: ')}",
                f"`disagg status --config {config}` runs the canary again now; if it still fails, report it with "
                f"`disagg status --config {config} --json` and the gateway's WARN line ({FIDELITY_DOC}). Only a pair "
                f"whose figures were checked by hand may carry KV anyway: a [[fidelity.override]] with usable = true "
                f"and its reason. Meanwhile its requests prefill on {row['decode']}: right, only slower")
    if state in ("pending", "checking"):
        return (f"KV fidelity of {pair} not judged yet ({state}"
                + (f": {row['reverify']}" if row.get("reverify") else "") + ")",
                f"wait for the canary (it runs when both nodes are up), or `disagg status --config {config}` runs "
                f"it now; then smoke again")
    if state == "unchecked":
        return (f"{pair}: the canary is off ([fidelity] enabled = false) and [fidelity] required = true",
                f"set [fidelity] enabled = true in {config} (or required = false to carry KV unverified)")
    return (f"KV fidelity of {pair} could not be checked: {row.get('last_error') or summary}",
            f"`disagg status --config {config}` probes the link and runs the canary; `disagg doctor --config "
            f"{config} --node NAME` on {row['prefill']} and {row['decode']}")


# ---- the request ----

async def _json(http: aiohttp.ClientSession, method: str, url: str, headers: dict, **kw) -> tuple[int, dict, dict]:
    async with http.request(method, url, headers=headers, **kw) as r:
        try:
            body = await r.json(content_type=None)
        except ValueError:
            body = {"error": (await r.text())[:200]}
        return r.status, dict(r.headers), body if isinstance(body, dict) else {"body": body}


async def build_prompt(http, url: str, headers: dict, model: str, target: int) -> tuple[str, int]:
    """(text, its chat-templated token count by the gateway's own /tokenize) of about `target` tokens."""
    nonce, notes = uuid.uuid4().hex[:12], max(1, target // 12)
    for _ in range(4):
        text = prompt_text(notes, nonce)
        status, _, body = await _json(http, "POST", f"{url}/tokenize", headers,
                                      json={"model": model, "messages": [{"role": "user", "content": text}]})
        if status != 200:
            raise Refused(status, f"the gateway's /tokenize answered HTTP {status}: {_message(body)}")
        n = body["count"]
        if target <= n <= target * 1.1:
            break
        notes = max(1, int(notes * target / n) + 1)
    return text, n


class Refused(Exception):
    """The gateway answered, with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _message(body: dict) -> str:
    err = body.get("error")
    return str(err.get("message") if isinstance(err, dict) else err or body)[:300]


def metric(text: str, name: str, model: str) -> float:
    """One sample of the gateway's /metrics for `model` (0 when absent)."""
    m = re.search(rf'^{re.escape(name)}\{{[^}}]*model="{re.escape(model)}"[^}}]*\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


async def _kv_metrics(http, url: str, headers: dict, model: str) -> tuple[float, float, float] | None:
    """(KV transfers, bytes, seconds) the gateway counted so far for `model`; None when /metrics does not answer."""
    try:
        async with http.get(f"{url}/metrics", headers=headers) as r:
            text = await r.text() if r.status == 200 else None
    except aiohttp.ClientError:
        return None
    if text is None:
        return None
    return tuple(metric(text, f"disagg_kv_transfer_{n}", model) for n in ("seconds_count", "bytes_total",
                                                                           "seconds_sum"))


def _read_answer(smoke: Smoke, headers: dict, body: dict) -> None:
    """The path and figures of a 200 answer: the x-disagg headers and Ollama's durations (ns)."""
    h = {k.lower(): v for k, v in headers.items()}
    smoke.path, smoke.decode_node = h.get("x-disagg-path"), h.get("x-disagg-decode-node")
    smoke.kv_tokens = int(h.get("x-disagg-kv-tokens") or 0)
    smoke.prefix_tokens = int(h.get("x-disagg-prefix-tokens") or 0)
    smoke.prefill_s = float(h.get("x-disagg-prefill-ms") or 0) / 1000 or None
    smoke.fallbacks = [f for f in (h.get("x-disagg-fallbacks") or "").split(",") if f]
    if h.get("x-disagg-predicted-ttft-ms"):
        smoke.predicted_ttft_ms = float(h["x-disagg-predicted-ttft-ms"])
    smoke.prompt_tokens = int(body.get("prompt_eval_count") or 0)
    smoke.ttft_s = (body.get("load_duration", 0) + body.get("prompt_eval_duration", 0)) / 1e9
    smoke.decode_tokens = int(body.get("eval_count") or 0)
    if body.get("eval_duration") and smoke.decode_tokens > 1:
        smoke.decode_tokens_per_s = smoke.decode_tokens / (body["eval_duration"] / 1e9)


async def run_model(http, url: str, headers: dict, route: ModelRoute, tokens: int | None, max_tokens: int) -> Smoke:
    """One smoke request of `route` through the gateway at `url` (the gateway's /health read by the caller)."""
    smoke = Smoke(route.id)
    try:
        text, _ = await build_prompt(http, url, headers, route.id, target_tokens(route, tokens, max_tokens))
        before = await _kv_metrics(http, url, headers, route.id)
        body = {"model": route.id, "messages": [{"role": "user", "content": text}], "stream": False,
                "options": {"num_predict": max_tokens, "temperature": 0}}
        smoke.status, got, answer = await _json(http, "POST", f"{url}/api/chat", headers, json=body)
        after = await _kv_metrics(http, url, headers, route.id)
    except Refused as e:
        smoke.status, smoke.error = e.status, str(e)
        return smoke
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        smoke.error = f"{type(e).__name__}: {e}".rstrip(": ")
        return smoke
    if smoke.status != 200:
        smoke.error = f"the gateway answered HTTP {smoke.status}: {_message(answer)}"
        return smoke
    _read_answer(smoke, got, answer)
    if before is not None and after is not None and after[0] - before[0] == 1:  # this request's transfer alone
        smoke.kv_bytes, smoke.kv_transfer_s = int(after[1] - before[1]), after[2] - before[2]
    return smoke


async def collect(settings: Settings, routes: list[ModelRoute], url: str, key: ClientKey, tokens: int | None = None,
                  max_tokens: int = 32, timeout: float = 600.0, config: str = "config.toml") -> dict:
    """Every model's smoke, one after another (two at once would share nodes and muddle each other's figures)."""
    results, health = [], None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout, connect=10)) as http:
        for route in routes:
            smoke = await run_model(http, url, key.headers, route, tokens, max_tokens)
            try:
                _, _, health = await _json(http, "GET", f"{url}/health", key.headers)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                health = None
            diagnose(smoke, route, health, key, config, url)
            results.append(smoke)
    return {"url": url, "models": results}


def _fig(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render(result: dict) -> str:
    rows = [("MODEL", "PATH", "PROMPT", "HELD", "KV TOKENS", "KV MiB", "TTFT s", "PREFILL s", "KV s", "DECODE tok/s",
             "DECODE NODE")]
    for s in result["models"]:
        rows.append((s.model, s.path or (f"HTTP {s.status}" if s.status else "-"), str(s.prompt_tokens or "-"),
                     str(s.prefix_tokens), str(s.kv_tokens), _fig(None if s.kv_bytes is None else s.kv_bytes / 2**20, ".1f"),
                     _fig(s.ttft_s, ".2f"), _fig(s.prefill_s, ".2f"), _fig(s.kv_transfer_s, ".2f"),
                     _fig(s.decode_tokens_per_s, ".1f"), s.decode_node or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [("   " if i == 0 or s.ok else "!! ") + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
             for i, (r, s) in enumerate(zip(rows, [None, *result["models"]]))]
    for s in result["models"]:
        lines.append("")
        lines.append(f"{s.model}: " + ("disaggregated" if s.ok else "did NOT take the disaggregated path"))
        for row in s.fidelity:
            lines.append(f"   KV fidelity {row['prefill']} -> {row['decode']}: {row.get('summary') or row['state']}")
        for cause, remedy in s.causes:
            lines += [f"   cause: {cause}", f"   remedy: {remedy}"]
        for note, remedy in s.notes:
            lines += [f"   note: {note}", f"   remedy: {remedy}"]
    return "\n".join(lines)


def to_json(result: dict) -> dict:
    models = [{**asdict(s), "causes": [{"cause": c, "remedy": r} for c, r in s.causes],
               "notes": [{"note": n, "remedy": r} for n, r in s.notes]} for s in result["models"]]
    return {"url": result["url"], "ok": all(s.ok for s in result["models"]), "models": models}


def select(settings: Settings, names: list[str] | None) -> list[ModelRoute]:
    """--model (ids or aliases, each once) or every [[models]] route; an unknown name is a config error."""
    if not names:
        return list(settings.models)
    out = []
    for name in names:
        route = settings.route(name)
        if route is None:
            raise ConfigError(f"smoke: --model {name!r} is not in [[models]]; known: "
                              f"{[m.id for m in settings.models]}")
        if route not in out:
            out.append(route)
    return out


def main(settings: Settings, config: str, models: list[str] | None = None, as_json: bool = False,
         url: str | None = None, key: str | None = None, tokens: int | None = None, max_tokens: int = 32,
         timeout: float = 600.0) -> int:
    """Exit 0 when every model's request took the disaggregated path, 1 otherwise (each cause with its remedy)."""
    routes = select(settings, models)
    for route in routes:  # a prompt that cannot take the split is the config's or the flags' fault: before any request
        target_tokens(route, tokens, max_tokens)
    gateway = (url or settings.gateway.url()).rstrip("/")
    started = time.monotonic()
    result = asyncio.run(collect(settings, routes, gateway, client_key(settings, key), tokens, max_tokens, timeout,
                                 config))
    if as_json:
        print(json.dumps(to_json(result), indent=2))
    else:
        print(render(result) + f"\n\n{len(routes)} model(s) in {time.monotonic() - started:.1f} s against {gateway}")
    return 0 if all(s.ok for s in result["models"]) else 1


if __name__ == "__main__":
    sys.exit("run as `disagg smoke --config FILE`")
