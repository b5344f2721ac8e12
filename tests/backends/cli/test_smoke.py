"""`disagg smoke` over the fake cluster (a real gateway app, fake nodes: tests/support/fakes.py): the disaggregated
path with its figures, and each way it is missed (a failed canary, a prefill node down, a KV fallback, no gateway, a
refused key, an override, the gateway's pricing) named with its remedy. The e2e runs: test_smoke_e2e.py (the session
stack) and tests/kv_bridge/test_fidelity_faults_e2e.py (a pair whose canary fails)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from backends.cli import smoke
from backends.cli.status import ClientKey
from kv_bridge.config.source import ConfigError
from tests.support.fakes import MODEL_ID, Cluster, free_port, make_settings

NO_KEY = ClientKey(None, "none (the gateway runs open)")
CONFIG = "site.toml"


async def run(c: Cluster, url: str | None = None, **kw) -> smoke.Smoke:
    result = await smoke.collect(c.settings, c.settings.models, url or c.url, NO_KEY, config=CONFIG, **kw)
    (s,) = result["models"]
    return s


async def up(c: Cluster, name: str, want: bool) -> bool:
    async with c.http.get(f"{c.url}/health") as r:
        return any(n["name"] == name and n["up"] is want for n in (await r.json())["nodes"])


async def test_a_long_prompt_takes_the_split_with_its_figures(cluster):
    s = await run(cluster)
    assert s.ok and s.causes == [] and (s.status, s.path, s.decode_node) == (200, "disaggregated", "decode-0")
    assert 512 <= s.prompt_tokens <= 1.1 * 512  # twice min_disagg_tokens (32), raised to the 512 floor
    assert s.prefix_tokens == 0 and s.kv_tokens == s.prompt_tokens - 1  # the last token runs on the decode node
    assert cluster.prefill.requests[-1]["token_ids"] == cluster.decode.requests[-1]["token_ids"][:-1]
    # The fake decode node reports 1000 B a token and 0.02 s a transfer: /metrics' counters moved by this one request
    assert s.kv_bytes == 1000 * s.kv_tokens and s.kv_transfer_s == pytest.approx(0.02)
    assert s.ttft_s > 0 and s.prefill_s > 0 and s.decode_tokens > 1 and s.decode_tokens_per_s > 0
    assert [(r["prefill"], r["state"]) for r in s.fidelity] == [("prefill-0", "verified")]
    text = smoke.render({"url": cluster.url, "models": [s]})
    assert "!!" not in text and "smollm2:135m: disaggregated" in text and "KV fidelity prefill-0 -> decode-0: verified" \
        in text
    assert smoke.to_json({"url": cluster.url, "models": [s]})["ok"] is True


async def test_each_run_sends_a_new_prompt(cluster):
    await run(cluster)
    await run(cluster)
    first, second = (r["token_ids"] for r in cluster.decode.requests[-2:])
    same = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert same < 50  # a nonce right after the chat template's header: no decode node holds the rest as a prefix


async def test_a_failed_canary_is_named_with_its_layer_and_the_remedies(empty_config):
    c = Cluster()
    c.decode.fidelity_error = 1.7  # past float32's tolerance: the gateway's canary fails the pair
    await c.start()
    try:
        s = await run(c)
    finally:
        await c.stop()
    assert not s.ok and s.path == "local" and s.kv_tokens == 0
    ((cause, remedy),) = s.causes
    assert cause.startswith(f"KV fidelity of {MODEL_ID} prefill-0 -> decode-0 FAILED: worst K layer 3")
    assert f"`disagg status --config {CONFIG}`" in remedy and "report it" in remedy
    assert "[[fidelity.override]] with usable = true" in remedy and "docs/kv_bridge.md" in remedy
    text = smoke.render({"url": c.url, "models": [s]})
    assert text.splitlines()[1].startswith("!! ") and "did NOT take the disaggregated path" in text
    assert smoke.to_json({"url": c.url, "models": [s]})["ok"] is False


async def test_a_prefill_node_down_names_it_and_its_doctor(cluster):
    cluster.prefill.down = True
    await cluster.wait_for(lambda: up(cluster, "prefill-0", False))
    s = await run(cluster)
    assert not s.ok and s.path == "local"
    (cause, remedy), = s.causes
    assert cause.startswith("prefill node prefill-0 is down: /health answered HTTP 503")
    assert remedy == f"on prefill-0: `disagg doctor --config {CONFIG} --node prefill-0`, then that service's log"


async def test_a_kv_fallback_names_its_reason(cluster):
    cluster.decode.mode = "kv_error"
    s = await run(cluster)
    assert not s.ok and s.path == "fallback" and s.fallbacks == ["kv_error"]
    assert "(kv_error): decode-0 prefilled the prompt itself" in s.causes[0][0]
    assert "probes each prefill -> decode link" in s.causes[0][1]


async def test_no_gateway_there(cluster):
    url = f"http://127.0.0.1:{free_port()}"
    s = await run(cluster, url=url)
    assert not s.ok and s.status is None
    (cause, remedy), = s.causes
    assert cause.startswith(f"no answer from the gateway at {url}: ClientConnectorError")
    assert "`disagg doctor --config site.toml --node gateway`" in remedy and "--url" in remedy


def _settings(**route):
    """Settings of one decode and one prefill node (addresses only: nothing is called)."""
    node = lambda name: SimpleNamespace(name=name, port=free_port(), kv_port=free_port())  # noqa: E731
    return make_settings([node("decode-0")], [node("prefill-0")], route=route)


def test_the_prompt_is_long_enough_for_the_split_and_fits_the_model():
    (r,) = _settings(min_disagg_tokens=512, max_model_len=32768).models
    assert smoke.target_tokens(r, None, 32) == 1024
    assert smoke.target_tokens(r, 4000, 32) == 4000
    (short,) = _settings(min_disagg_tokens=3, max_model_len=500).models
    assert smoke.target_tokens(short, None, 32) == 500 - 32 - 16
    with pytest.raises(ConfigError, match="not above smollm2:135m's min_disagg_tokens 512"):
        smoke.target_tokens(r, 400, 32)
    (tight,) = _settings(min_disagg_tokens=590, max_model_len=600).models
    with pytest.raises(ConfigError, match="leaves no prompt within max_model_len 600"):
        smoke.target_tokens(tight, None, 32)


def test_models_by_id_or_alias_once_and_unknown_refused():
    s = _settings(aliases=["smol"])
    assert [m.id for m in smoke.select(s, None)] == [MODEL_ID]
    assert [m.id for m in smoke.select(s, ["smol", MODEL_ID])] == [MODEL_ID]
    with pytest.raises(ConfigError, match="--model 'gpt' is not in"):
        smoke.select(s, ["gpt"])


def _local(**row) -> smoke.Smoke:
    """A local answer on decode-0, diagnosed against a /health where every node is up and the pair's row is `row`."""
    s = smoke.Smoke(MODEL_ID, status=200, path="local", decode_node="decode-0", predicted_ttft_ms=812.0)
    (route,) = _settings().models
    health = {"nodes": [{"name": "prefill-0", "up": True}, {"name": "decode-0", "up": True}],
              "fidelity": [{"model": MODEL_ID, "prefill": "prefill-0", "decode": "decode-0", **row}]}
    smoke.diagnose(s, route, health, NO_KEY, CONFIG, "http://gw")
    return s


def test_why_local_from_the_pairs_row():
    (c, r), = _local(state="verified", usable=False, override={"usable": False, "reason": "Mac-only week"}).causes
    assert "ruled out by a [[fidelity.override]]: Mac-only week" in c and "remove that override" in r
    (c, r), = _local(state="checking", usable=False, reverify="decode-0 restarted").causes
    assert "not judged yet (checking: decode-0 restarted)" in c and "`disagg status --config site.toml`" in r
    (c, r), = _local(state="unchecked", usable=False).causes
    assert "the canary is off" in c and "[fidelity] enabled = true" in r
    (c, r), = _local(state="error", usable=False, last_error="KV timed out").causes
    assert c.endswith("could not be checked: KV timed out") and "--node NAME` on prefill-0 and decode-0" in r
    (c, r), = _local(state="verified", usable=True).causes  # usable and up, yet priced local
    assert "priced local prefill on decode-0 sooner (predicted TTFT 812 ms)" in c and "`rates`" in r


def test_a_refused_key_says_how_to_give_one():
    s = smoke.Smoke(MODEL_ID, status=401, error="the gateway answered HTTP 401: invalid API key")
    (route,) = _settings().models
    smoke.diagnose(s, route, None, ClientKey(None, "none", "no API key here (api_keys_file unreadable)"), CONFIG, "u")
    (c, r), = s.causes
    assert c == "the gateway wants a client key: no API key here (api_keys_file unreadable)"
    assert "--key KEY or set DISAGG_API_KEY" in r


async def test_a_node_down_that_the_request_did_not_need_is_a_note(empty_config):
    c = await Cluster(n_prefill=2).start()
    try:
        c.prefills[1].down = True
        await c.wait_for(lambda: up(c, "prefill-1", False))
        s = await run(c)
    finally:
        await c.stop()
    assert s.ok and s.causes == [] and s.path == "disaggregated"
    (note, remedy), = s.notes
    assert note.startswith("prefill node prefill-1 is down") and "--node prefill-1" in remedy
    assert "   note: prefill node prefill-1 is down" in smoke.render({"url": c.url, "models": [s]})


async def test_a_model_the_gateway_does_not_serve_is_its_answer(cluster):
    """A config newer than the running gateway: the gateway's own refusal, with its status."""
    other = cluster.settings.models[0].model_copy(update={"id": "qwen3-coder:30b", "aliases": []})
    result = await smoke.collect(cluster.settings, [other], cluster.url, NO_KEY, config=CONFIG)
    (s,) = result["models"]
    assert not s.ok and s.status == 404 and s.path is None
    (cause, remedy), = s.causes
    assert cause.startswith("the gateway's /tokenize answered HTTP 404:") and "qwen3-coder:30b" in cause
    assert remedy == f"the running gateway does not serve qwen3-coder:30b: restart it with {CONFIG}, or --model one " \
        f"it lists at {cluster.url}/v1/models"


def test_a_config_no_prompt_can_split_is_refused_before_any_request(empty_config, tmp_path, capsys):
    from backends.cli.main import main

    cfg = tmp_path / "site.toml"
    cfg.write_text(f'[gateway]\nport = {free_port()}\n[[nodes]]\nname = "mac-0"\nrole = "decode"\nport = {free_port()}\n'
                   f'kv_port = {free_port()}\n[[models]]\nid = "m"\npath = "{tmp_path}"\ndecode = ["mac-0"]\n'
                   f'max_model_len = 512\nmin_disagg_tokens = 600\n')
    assert main(["smoke", "--config", str(cfg)]) == 2
    assert "m's min_disagg_tokens 600 leaves no prompt within max_model_len 512" in capsys.readouterr().err
    assert main(["smoke", "--config", str(cfg), "--model", "gpt-oss:120b"]) == 2
    assert "--model 'gpt-oss:120b' is not in [[models]]; known: ['m']" in capsys.readouterr().err
