"""`disagg bench grading` (issue 33 items 1-2): the class's workload, the cost model's event simulation on
hand-checkable cases, the published-rate prediction of the real site, the queue-wait header the timeline reads, and
the command end to end against fake nodes (its JSON, its PNG, the Mac-alone baseline through a second gateway)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from tests.support.fakes import MODEL_DIR, MODEL_ID, Cluster, free_port
from tests.support import ROOT
from backends.grading import replay as grading
from backends.grading.predict import Call, ModelRates, Route, Site, simulate, summary



def test_workload_is_the_apps_two_calls_per_submission_seeded_and_scaled():
    calls = grading.workload(5, ["coder", "oss"], scale=0.1, seed=7)
    assert len(calls) == 10 and calls == grading.workload(5, ["coder", "oss"], scale=0.1, seed=7)
    assert [c.model for c in calls] == ["coder", "oss"] * 5
    assert [c.json_format for c in calls] == [True, False] * 5  # format json on the analysis call only
    assert {c.lane for c in calls if c.model == "coder"} == {0} and {c.lane for c in calls if c.model == "oss"} == {1}
    for c in calls:
        assert 600 <= c.target_tokens <= 2500 and 200 <= c.num_predict <= 350
        assert c.prompt.startswith(grading.RUBRIC) and "JSON" in c.prompt
    assert calls[0].prompt != grading.workload(5, ["coder", "oss"], scale=0.1, seed=8)[0].prompt
    other = grading.workload(5, ["coder", "oss"], scale=0.1, seed=7, texts="mac-alone")  # the baseline's class
    assert [(c.target_tokens, c.num_predict, c.seed) for c in other] == [
        (c.target_tokens, c.num_predict, c.seed) for c in calls]
    skip = len(grading.RUBRIC) + 300
    assert all(a.prompt[skip:] != b.prompt[skip:] for a, b in zip(calls, other))
    wide = grading.workload(8, ["coder", "oss"], concurrency=8)
    assert {c.lane for c in wide if c.model == "coder"} == {0, 1, 2, 3}
    assert {c.lane for c in wide if c.model == "oss"} == {4, 5, 6, 7}


def test_prompt_lengths_land_near_their_drawn_token_counts():
    """Counted with the real SmolLM2 tokenizer: the drawn length is what the gateway will see, within 25%."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    for c in grading.workload(3, ["a", "b"], scale=0.1, seed=1):
        n = len(tok.encode(c.prompt).ids)
        assert 0.75 * c.target_tokens <= n <= 1.25 * c.target_tokens, (n, c.target_tokens)


def _site(max_inflight=None, capacity=float("inf"), decode_nodes=("m",), models=("a",), cost=0.0) -> Site:
    r = ModelRates(prefill=((0, 1000.0),), local_prefill=((0, 100.0),), decode=((0, 10.0),), kv_wire_bytes=100.0,
                   kv_hold_bytes=1.0)
    return Site({m: Route(("p",), tuple(decode_nodes), max_inflight) for m in models}, {m: r for m in models},
                link_bytes_per_s=1e6, kv_capacity_bytes=capacity, batch_cost=cost)


def test_one_request_is_prefill_then_transfer_left_over_then_ingest_then_decode():
    # 1000 tokens: prefill 1 s; KV 1000 x 100 B at 1 MB/s = 0.1 s, hidden under it; ingest 1000/20000 = 0.05 s;
    # 100 tokens at 10/s = 10 s
    [o] = simulate(_site(), [Call(0, "a", 1000, 100, 0)])
    assert o.path == "disaggregated" and o.node == "m"
    assert o.prefill_end == pytest.approx(1.0) and o.decode_start == pytest.approx(1.05)
    assert o.end == pytest.approx(11.05)
    assert summary([o])["dominant"] == "decode"


def test_past_max_inflight_the_second_request_waits_in_the_queue_and_the_queue_is_priced():
    outs = simulate(_site(max_inflight=1), [Call(0, "a", 1000, 100, 0), Call(1, "a", 1000, 100, 1)])
    assert outs[1].admitted == pytest.approx(11.05) and outs[1].end == pytest.approx(22.1)
    s = summary(outs)
    assert s["makespan_s"] == pytest.approx(22.1) and s["terms_s"]["queue"] == pytest.approx(11.05)


def test_kv_capacity_of_the_mac_queues_like_max_inflight():
    outs = simulate(_site(capacity=1500.0), [Call(0, "a", 1000, 100, 0), Call(1, "a", 1000, 100, 1)])
    assert outs[1].admitted == pytest.approx(11.05)


def test_mac_alone_prefills_on_the_mac_and_stalls_its_decoding_meanwhile():
    # local prefill 1000/100 = 10 s each, one after the other on the Mac; the first's decode waits for the second's
    # prefill (20 s), then both decode as one batch at batch_cost 0: 10 tok/s each, 10 s
    outs = simulate(_site(), [Call(0, "a", 1000, 100, 0), Call(1, "a", 1000, 100, 1)], "mac-alone")
    assert [o.path for o in outs] == ["local", "local"]
    assert outs[1].prefill_start == pytest.approx(10.0)
    assert [o.end for o in outs] == [pytest.approx(30.0), pytest.approx(30.0)]
    assert summary(outs)["terms_s"]["transfer"] == 0.0


def test_two_models_on_one_mac_take_turns_per_step_and_two_macs_do_not():
    calls = [Call(0, "a", 1000, 100, 0), Call(1, "b", 1000, 100, 1)]
    shared = simulate(_site(models=("a", "b")), calls)
    # both prefills on one prefill node: b's starts at 1 s; while both decode a round is 0.1 + 0.1 s
    assert shared[0].end == pytest.approx(1.05 + 1.0 + (100 - 10) * 0.2)
    apart = simulate(_site(models=("a", "b"), decode_nodes=("m0", "m1")), calls)
    assert {o.node for o in apart} == {"m0", "m1"} and apart[0].end == pytest.approx(11.05)


def test_batch_cost_slows_a_shared_batch():
    calls = [Call(0, "a", 1000, 100, 0), Call(1, "a", 1000, 100, 1)]
    free, costly = simulate(_site(cost=0.0), calls), simulate(_site(cost=1.0), calls)
    assert max(o.end for o in costly) > max(o.end for o in free)


def test_the_real_site_predicted_from_published_rates(tmp_path):
    from backends.grading import command as grading_cli
    from kv_bridge.config.settings import load_config

    config = ROOT / "examples" / "site.toml"
    args = type("A", (), {"submissions": 60, "scale": 1.0, "seed": 0, "concurrency": None, "models": None,
                          "batch_cost": None})()
    p = grading_cli.predict(load_config(config), config.parent, args)
    split, alone = p["split"], p["mac-alone"]
    assert alone["makespan_s"] > split["makespan_s"] and p["ratio"] > 1.2
    assert split["terms_s"]["prefill"] * 3 < alone["terms_s"]["prefill"]  # the Mac prefills ~3.8x slower
    assert split["dominant"] == "decode" and split["terms_s"]["queue"] == 0  # the app's two at once never queue
    # one lane per model, 60 calls each of ~50 s (decode 2000-3500 at ~60-76 tok/s + prefill): about an hour
    assert 40 * 60 < split["makespan_s"] < 80 * 60
    # speculative decoding as modelled (docs/speculative.md) shortens only the decode term
    spec = p["split+speculative"]
    assert spec["terms_s"]["decode"] < split["terms_s"]["decode"] and p["speculative_gain"] > 1.0
    assert spec["terms_s"]["prefill"] == split["terms_s"]["prefill"]


def test_segments_lay_a_request_out_on_the_client_clock():
    r = grading.Result(0, 0, "analysis", "m", 0, start=1.0, end=11.0, queue_s=2.0, prefill_s=1.5, ttft_s=4.0,
                       decode_s=5.0)
    s = grading.segments(r)
    # the first token came 4 s before the decode's 5: the generation began at 2 (1 s of network and tokenizing,
    # drawn as queued with the 2 s in the queue)
    assert s["queued"] == (1.0, 4.0) and s["prefill"] == (4.0, 5.5) and s["kv"] == (5.5, 6.0)
    assert s["decode"] == (6.0, 11.0)


# ---- through a gateway over fake nodes ----

async def test_the_queue_wait_is_in_the_answers_headers(empty_config):
    c = await Cluster(route={"max_inflight": 1}, gateway={"queue": {"poll_s": 0.05}}).start()
    try:
        gate = c.decode.hold = asyncio.Event()
        body = {"model": MODEL_ID, "prompt": "Hello", "stream": False, "options": {"num_predict": 4}}
        first = asyncio.create_task(c.post("/api/generate", body))
        await c.wait_for(lambda: _true(c.decode.running >= 1))
        second = asyncio.create_task(c.post("/api/generate", body))
        await asyncio.sleep(0.5)
        gate.set()
        (s1, h1, _), (s2, h2, _) = await first, await second
        assert s1 == s2 == 200
        waited = float(h2["x-disagg-queue-ms"])
        assert float(h1["x-disagg-queue-ms"]) < 100 <= waited
        # the cost model's time to first token includes the wait, as prompt_eval_duration does
        assert float(h2["x-disagg-predicted-ttft-ms"]) >= waited
    finally:
        await c.stop()


async def _true(v: bool) -> bool:
    return v


def _config(c: Cluster, folder: Path) -> Path:
    """The fake cluster's settings as a config file (for the Mac-alone gateway the command starts)."""
    s = c.settings
    lines = ["[gateway]", 'host = "127.0.0.1"', f"port = {free_port()}", "request_timeout_s = 30", ""]
    for n in s.nodes:
        lines += ["[[nodes]]", f'name = "{n.name}"', f'role = "{n.role}"', f'host = "{n.host}"', f"port = {n.port}"]
        lines += [f"kv_port = {n.kv_port}"] if n.role == "decode" else []
        lines.append("")
    for m in s.models:
        lines += ["[[models]]", f'id = "{m.id}"', f'path = "{m.path}"', f"prefill = {json.dumps(m.prefill)}",
                  f"decode = {json.dumps(m.decode)}", f"max_model_len = {m.max_model_len}",
                  f"min_disagg_tokens = {m.min_disagg_tokens}"]
    (folder / "grading.toml").write_text("\n".join(lines) + "\n")
    return folder / "grading.toml"


async def test_the_command_replays_a_class_and_the_mac_alone_baseline(empty_config, tmp_path, capsys):
    from backends.cli.main import main

    c = await Cluster().start()
    try:
        config = _config(c, tmp_path)
        argv = ["bench", "grading", "--config", str(config), "--url", c.url, "--submissions", "3", "--scale", "0.02",
                "--models", MODEL_ID, "--baseline", "mac-alone", "--json", str(tmp_path / "g.json"),
                "--png", str(tmp_path / "g.png"), "--no-progress"]
        rc = await asyncio.to_thread(main, argv)
    finally:
        await c.stop()
    out = capsys.readouterr().out
    assert rc == 0, out
    result = json.loads((tmp_path / "g.json").read_text())
    split, alone = result["runs"]
    assert split["mode"] == "split" and alone["mode"] == "mac-alone"
    for run in result["runs"]:
        assert run["measured"]["errors"] == 0 and run["measured"]["requests"] == 6
        assert run["predicted"]["makespan_s"] > 0 and run["measured"]["makespan_s"] > 0
        assert all(r["node"] == "decode-0" and r["output_tokens"] > 0 and r["segments"] for r in run["requests"])
    assert {r["path"] for r in split["requests"]} == {"disaggregated"}
    assert {r["path"] for r in alone["requests"]} == {"local"}  # the second gateway has no prefill node
    assert "measured" in out and "predicted" in out and "Mac-alone / split" in out
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_the_command_fails_on_any_error(empty_config, tmp_path):
    from backends.cli.main import main

    c = await Cluster().start()
    try:
        config = _config(c, tmp_path)
        c.decode.down = True  # every request fails: no decode node answers
        await c.decode.stop()
        argv = ["bench", "grading", "--config", str(config), "--url", c.url, "--submissions", "1", "--scale", "0.02",
                "--models", MODEL_ID, "--json", str(tmp_path / "g.json"), "--png", "", "--no-progress"]
        rc = await asyncio.to_thread(main, argv)
    finally:
        c.decoders = []
        await c.stop()
    assert rc == 1
    assert json.loads((tmp_path / "g.json").read_text())["runs"][0]["measured"]["errors"] == 2


def test_on_one_machine_busy_nodes_past_its_share_stretch_the_timeline():
    # one prefill node (1 s each, in turn) then two Macs decoding 10 s each at once
    calls = [Call(0, "a", 1000, 100, 0), Call(1, "a", 1000, 100, 1)]
    outs = simulate(_site(decode_nodes=("m0", "m1")), calls)
    assert summary(outs)["makespan_s"] == pytest.approx(12.05)
    assert {o.prefill_node for o in outs} == {"p"} and {o.node for o in outs} == {"m0", "m1"}
    one = summary(outs, shared=1.0)  # one node at full speed at a time: the class takes all its work in turn
    assert one["machine_bound_s"] == pytest.approx(2 * 1.0 + 2 * 10.0) and one["dominant"] == "machine"
    # processor sharing: the prefill node alone to 1.05 (m0 starts after the KV), with m0 to 2.0 (2 busy: twice as
    # long), m0 alone to 2.05 (the second's KV), both Macs to 11.05, m1 alone to 12.05
    assert one["makespan_s"] == pytest.approx(1.05 + 2 * 0.95 + 0.05 + 2 * 9.0 + 1.0)
    assert one["unshared_makespan_s"] == pytest.approx(12.05)
    assert summary(outs, shared=2.0)["makespan_s"] == pytest.approx(12.05)  # two at once: nothing stretches
    half = summary(outs, shared=1.5)["makespan_s"]
    assert 12.05 < half < one["makespan_s"]


def test_the_one_machine_term_is_the_cores_over_the_cpu_a_busy_node_costs(tmp_path):
    """`shared` from measurement: calls that cost the machine 4 CPU-s over 2 s of work use 2 cores a node; 2 cores run
    one at its measured speed, 8 cores four. The CPU seconds are the machine's (/proc/stat); a site is one machine
    when every node is on loopback."""
    from backends.grading import cpu as grading_cpu
    from kv_bridge.config.settings import load_config

    assert grading_cpu.shared(4.0, 2.0, 2) == (1.0, 2.0) and grading_cpu.shared(4.0, 2.0, 8) == (4.0, 2.0)
    assert grading_cpu.shared(0.0, 2.0, 2) == (None, None)  # nothing read: no stretch
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 20 30 5000 40 5 5 0 0 0\ncpu0 50 10 15 2500 20 2 3 0 0 0\n")
    assert grading_cpu.machine_cpu_seconds(str(stat)) == pytest.approx(160 / os.sysconf("SC_CLK_TCK"))
    assert grading_cpu.machine_cpu_seconds(str(tmp_path / "none")) is None  # macOS: no /proc/stat
    a, b = grading_cpu.machine_cpu_seconds(), grading_cpu.machine_cpu_seconds()
    assert a is not None and b >= a  # this machine's, moving forward

    def config(host: str) -> Path:
        path = tmp_path / f"{host}.toml"
        path.write_text(f"""[[nodes]]\nname = "p"\nrole = "prefill"\nhost = "{host}"\nport = 8100\n
[[nodes]]\nname = "d"\nrole = "decode"\nhost = "127.0.2.21"\nport = 8200\nkv_port = 8201\n""")
        return path

    assert grading_cpu.one_machine(load_config(config("127.0.1.11")))   # `make site`'s addresses
    assert grading_cpu.one_machine(load_config(config("localhost")))
    assert not grading_cpu.one_machine(load_config(config("10.0.0.5")))  # a Spark on the lab's network


def test_the_command_line_loads_without_the_replays_client():
    """`disagg` runs on a Mac or the gateway image without the dev extra: httpx and matplotlib load only in the
    replay."""
    import subprocess
    import sys

    code = "import sys, backends.cli.main; print(sorted(m for m in ('httpx', 'matplotlib') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
