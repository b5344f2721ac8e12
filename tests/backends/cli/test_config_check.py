"""`disagg config check FILE` on the seed site's example config, and the errors it must catch; the fingerprint's
stance on quantization (accepted, reported) versus geometry and tokenizer (refused)."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import MODEL_DIR, SITE, assert_config_error, run, site_copy, twin


def test_site_example_is_the_seed_site():
    from kv_bridge.config.settings import load_config

    s = load_config(SITE)
    assert len(s.models) == 2 and all(m.aliases for m in s.models)
    assert {m.id for m in s.models} == {"qwen3-coder:30b", "gpt-oss:120b"}
    assert "openai/gpt-oss-120b" in s.route("gpt-oss:120b").aliases
    assert "Qwen/Qwen3-Coder-30B-A3B-Instruct-FP8" in s.route("qwen3-coder:30b").aliases
    assert sorted(n.role for n in s.nodes) == ["decode", "decode", "prefill", "prefill"]
    assert all(m.max_model_len >= 32768 for m in s.models)
    assert s.kv.wire_dtype == "float8_e4m3"
    assert s.auth.api_keys_file and s.auth.node_secret_file  # auth on: clients and nodes
    for n in s.nodes:
        if n.role == "decode":  # KV on its own link, HTTP on the LAN
            assert n.kv_host and n.kv_host != n.host and n.kv_target["host"] == n.kv_host


def test_check_prints_each_machine(tmp_path):
    r = run("config", "check", str(site_copy(tmp_path)), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    for needle in ("spark-0", "spark-1", "mac-0", "mac-1", "<- 10.10.0.21:8201", "openai/gpt-oss-120b",
                   "disagg decode --node mac-1", "config OK"):
        assert needle in r.stdout, (needle, r.stdout)
    assert "node_secret_file" not in r.stdout  # the secret files are there: no warning about them


def test_check_json_and_missing_secrets_warn(tmp_path):
    r = run("config", "check", str(site_copy(tmp_path, secrets=False)), "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert [m["name"] for m in out["machines"]] == ["gateway", "spark-0", "spark-1", "mac-0", "mac-1"]
    assert out["errors"] == []
    assert any("node_secret_file" in w for w in out["warnings"])


@pytest.mark.parametrize("edit, needle", [
    (lambda t: t.replace('aliases = ["openai/gpt-oss-120b"]', 'aliases = ["qwen3-coder:30b"]'),
     "model ids and aliases must be unique"),
    (lambda t: t.replace('decode = ["mac-0", "mac-1"]\nmax_model_len = 32768\nmin_disagg_tokens = 512\nmax_inflight = 4\n'
                         '\n[[models]]', 'decode = ["mac-0", "mac-1"]\nmax_model_len = 32768\n\n[[models]]')
     .replace('prefill = ["spark-1"]', 'prefill = ["spark-0"]'), "runs 2 vLLM engines"),
    (lambda t: t.replace('kv_host = "10.10.0.22"\nkv_port = 8201', 'kv_host = "10.10.0.22"\nkv_port = 8200')
     .replace('host = "192.168.10.22"', 'host = "10.10.0.22"'), "is also mac-1 HTTP's"),
    (lambda t: t.replace('max_model_len = 32768', 'max_model_len = 200000', 1), "max_model_len 200000 > kv.max_tokens"),
])
def test_check_errors(tmp_path, edit, needle):
    r = run("config", "check", str(site_copy(tmp_path, edit=edit)), cwd=tmp_path)
    if r.returncode == 2 and needle in r.stderr:  # caught by the schema itself
        assert_config_error(r, needle)
        return
    assert r.returncode == 2 and needle in r.stdout, r.stdout + r.stderr


def test_exposed_node_without_secret_is_an_error(tmp_path):
    r = run("config", "check", str(site_copy(tmp_path, secrets=False, edit=lambda t: t.replace(
        'node_secret_file = "node-secret"', ''))), cwd=tmp_path)
    assert r.returncode == 2 and "no node secret is set" in r.stdout, r.stdout + r.stderr


def test_fingerprint_accepts_quantization_refuses_geometry_and_tokenizer(tmp_path):
    from kv_bridge.fingerprint import model_fingerprint, model_quantization

    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip("embedded model not prepared (make models)")
    base = model_fingerprint(str(MODEL_DIR))
    mlx4 = twin(tmp_path, "mlx4", config=lambda c: {**c, "dtype": "bfloat16", "torch_dtype": "bfloat16",
                                                       "quantization": {"group_size": 64, "bits": 4}})
    assert model_fingerprint(str(mlx4)) == base
    assert model_quantization(mlx4) == "mlx 4-bit (group 64)" and model_quantization(MODEL_DIR) == "float32"
    fp8 = twin(tmp_path, "fp8", config=lambda c: {**c, "quantization_config": {"quant_method": "fp8"}})
    assert model_fingerprint(str(fp8)) == base and model_quantization(fp8) == "fp8"
    heads = twin(tmp_path, "heads", config=lambda c: {**c, "num_key_value_heads": 1})
    assert model_fingerprint(str(heads)) != base

    def other_vocab(t):
        vocab = t["model"]["vocab"]
        a, b = list(vocab)[100:102]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        return t
    assert model_fingerprint(str(twin(tmp_path, "tok", tokenizer=other_vocab))) != base
