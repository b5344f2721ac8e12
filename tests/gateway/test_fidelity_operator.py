"""POST /fidelity is an operator's (issue #50): with client keys set, an operator key or the node token forces a
re-check and a client key is refused (403); no operator credential configured: 403 naming the fix; the gateway open
(no keys, the embedded default): anyone; at most every [fidelity] recheck_min_s per pair (429, Retry-After), while
GET /health reads the verdicts freely."""

from __future__ import annotations

import pytest

from tests.support.fakes import Cluster

CLIENT, OPERATOR, SECRET = "sk-client-0123456789abcdef", "op-operator-0123456789abcdef", "node-secret-0123456789abcdef"


async def _post(c: Cluster, key: str | None) -> tuple[int, dict, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with c.http.post(c.url + "/fidelity", headers=headers) as r:
        return r.status, dict(r.headers), await r.json()


@pytest.mark.parametrize("auth", [{"api_keys": [CLIENT], "operator_keys": [OPERATOR]},
                                  {"api_keys": [CLIENT], "node_secret": SECRET}])
async def test_only_an_operator_forces_a_recheck_at_most_every_recheck_min_s(empty_config, monkeypatch, auth):
    from kv_bridge.config.auth import AuthConfig

    for key, value in auth.items():
        monkeypatch.setenv(f"DISAGG_AUTH__{key.upper()}", value if isinstance(value, str) else ",".join(value))
    c = await Cluster(fidelity={"recheck_min_s": 600}).start()
    try:
        op = OPERATOR if "operator_keys" in auth else AuthConfig(node_secret=SECRET).node_token()
        status, _, body = await _post(c, CLIENT)
        assert status == 403 and "client key cannot force" in body["error"]["message"]
        assert (await _post(c, None))[0] == 401 and (await _post(c, "sk-wrong-0123456789abcdef"))[0] == 401
        canaries = c.decode.canaries
        status, _, body = await _post(c, op)
        assert status == 200 and body["pairs"][0]["state"] == "verified" and c.decode.canaries == canaries + 1
        status, headers, body = await _post(c, op)
        assert status == 429 and 590 <= int(headers["Retry-After"]) <= 600 and "recheck_min_s" in body["error"]["message"]
        assert c.decode.canaries == canaries + 1
        async with c.http.get(c.url + "/health") as r:
            assert r.status == 200 and (await r.json())["fidelity"][0]["state"] == "verified"
    finally:
        await c.stop()


async def test_client_keys_without_an_operator_credential_refuse_with_the_fix(empty_config, monkeypatch):
    monkeypatch.setenv("DISAGG_AUTH__API_KEYS", CLIENT)
    c = await Cluster().start()
    try:
        status, _, body = await _post(c, CLIENT)
        assert status == 403 and "set [auth] operator_keys" in body["error"]["message"]
    finally:
        await c.stop()


async def test_an_open_gateway_lets_anyone_recheck(cluster):
    assert (await _post(cluster, None))[0] == 200
