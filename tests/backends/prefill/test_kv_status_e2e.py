"""A prefill node whose KV stream never opens answers its call 502 kv_not_delivered (the gateway then aborts the
transfer at once), told by the connector's sender inside vLLM's engine (kv_bridge/send_status.py); the session stack."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.support.stack import MODEL_ID, free_port

pytestmark = pytest.mark.e2e


def test_a_kv_target_nobody_listens_on_fails_the_prefill_call(stack):
    body = {"model": MODEL_ID, "token_ids": list(range(100, 140)), "request_id": "nobody-listens",
            "kv_target": {"host": "127.0.0.1", "port": free_port()}}
    req = urllib.request.Request(stack.url("prefill-0") + "/v1/prefill", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **stack.node_headers})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=120)
    err = json.loads(e.value.read())["error"]
    assert e.value.code == 502 and err["code"] == "kv_not_delivered", err
    assert "cannot open KV stream" in err["message"] and "nobody-listens" in err["message"], err
