"""`disagg config check` budgets each machine: a Mac's weights + prefix caches + in-flight KV + pool against its RAM,
a Spark's vLLM share against what vLLM finds free at start, model folders against disk; and prints how each role
starts (the prefill container's run flags, the Mac install script)."""

from __future__ import annotations

import json
import re

from test_cli import run
from test_config_check import site_copy


def check(tmp_path, edit=lambda t: t, *extra):
    r = run("config", "check", str(site_copy(tmp_path, edit=edit)), *extra, cwd=tmp_path)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def test_site_defaults_fit_a_128g_spark_and_a_96g_mac(tmp_path):
    r = check(tmp_path, lambda t: t, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["errors"] == []
    by = {b["node"]: b for b in out["budgets"]}
    assert set(by) == {"spark-0", "spark-1", "mac-0", "mac-1"}
    mac = by["mac-0"]
    assert set(mac["memory_gib"]) == {"qwen3-coder:30b weights", "gpt-oss:120b weights", "prefix caches (2 models)",
                                      "in-flight KV", "receive pool"}
    assert 80 < sum(mac["memory_gib"].values()) <= mac["available_gib"] < 96
    assert sum(by["spark-1"]["memory_gib"].values()) <= by["spark-1"]["available_gib"] <= 102
    assert not [w for w in out["warnings"] if "not budgeted" in w or "_weights_gib" in w]


def test_over_budget_mac_is_refused(tmp_path):
    """The old site default: 16 GiB of prefix cache per model and 24 GiB in flight on a 96 GiB Mac."""
    r = check(tmp_path, lambda t: t.replace("prefix_cache_bytes = 1610612736", "prefix_cache_bytes = 17179869184")
              .replace("max_inflight_bytes = 6710886400", "max_inflight_bytes = 25769803776"))
    assert r.returncode == 2, r.stdout
    err = [line for line in r.stdout.splitlines() if line.startswith("ERROR")]
    assert len(err) == 2 and all("decode node 'mac-" in e for e in err), err
    assert re.search(r"needs 1[0-9]{2}\.\d GiB .* but has 88\.0 GiB", err[0]), err[0]
    assert "prefix_cache_bytes" in err[0]


def test_bigger_mac_takes_the_old_defaults(tmp_path):
    r = check(tmp_path, lambda t: t.replace("prefix_cache_bytes = 1610612736", "prefix_cache_bytes = 17179869184")
              .replace("memory_gib = 96", "memory_gib = 192"))
    assert r.returncode == 0, r.stdout


def test_spark_gpu_share_vllm_would_refuse(tmp_path):
    """0.85 x 128 GiB is more than a GB10 has free at start: vLLM's start-up check would refuse it."""
    r = check(tmp_path, lambda t: t.replace("gpu_memory_utilization = 0.75", "gpu_memory_utilization = 0.85"))
    assert r.returncode == 2, r.stdout
    err = [line for line in r.stdout.splitlines() if line.startswith("ERROR")]
    assert len(err) == 2 and all("prefill node 'spark-" in e and "refuses to start" in e for e in err), err
    assert "108.8 GiB" in err[0] and "gpu_memory_utilization <= 0.79" in err[0]


def test_spark_share_too_small_for_the_weights(tmp_path):
    r = check(tmp_path, lambda t: t.replace("gpu_memory_utilization = 0.75", "gpu_memory_utilization = 0.4"))
    assert r.returncode == 2
    assert "prefill node 'spark-1': gpt-oss:120b weights 60.8 GiB do not fit" in r.stdout
    assert "spark-0': qwen3-coder" not in r.stdout  # 30.5 GiB fits 51.2


def test_disk_too_small(tmp_path):
    r = check(tmp_path, lambda t: t.replace("memory_gib = 96\ndisk_gib = 900", "memory_gib = 96\ndisk_gib = 60"))
    assert r.returncode == 2
    assert "node 'mac-1': its model folders take 77.1 GiB" in r.stdout and "'mac-0'" not in r.stdout


def test_measured_folder_and_unknown_sizes(tmp_path):
    """No declared size: a folder that is here is measured (for the side it is); else a warning names the field."""
    folder = tmp_path / "m"
    folder.mkdir()
    cfg = {"model_type": "llama", "num_hidden_layers": 36, "num_key_value_heads": 8, "head_dim": 64,
           "num_attention_heads": 64, "hidden_size": 2880, "quantization": {"bits": 4, "group_size": 64}}
    (folder / "config.json").write_text(json.dumps(cfg))
    with open(folder / "model.safetensors", "wb") as f:
        f.truncate(70 * 2**30)  # sparse: 70 GiB on paper
    edit = (lambda t: t.replace('path = "/opt/disagg/models/gpt-oss-120b"', f'path = "{folder}"')
            .replace("prefill_weights_gib = 60.8", "").replace("decode_weights_gib = 61.0", ""))
    r = check(tmp_path, edit, "--json")
    out = json.loads(r.stdout)
    mac = next(b for b in out["budgets"] if b["node"] == "mac-0")
    assert mac["memory_gib"]["gpt-oss:120b weights"] == 70.0
    assert any("decode node 'mac-0' needs" in e for e in out["errors"])
    # an MLX folder is not the Spark's checkpoint: spark-1's size stays unknown, and says which field to set
    assert any(w.startswith("spark-1: weight size of ['gpt-oss:120b'] unknown") and "prefill_weights_gib" in w
               for w in out["warnings"])


def test_start_lines_carry_the_run_flags(tmp_path):
    r = check(tmp_path, lambda t: t)
    start = r.stdout.split("\nSTART\n")[1]
    spark = next(line for line in start.splitlines() if line.strip().startswith("spark-0:"))
    for flag in ("--gpus all", "--network host", "--ipc=host", "-v /opt/disagg:/opt/disagg:ro",
                 "-e DISAGG_CONFIG=/opt/disagg/config.toml", "-v disagg-cache:/root/.cache", "--node spark-0"):
        assert flag in spark, (flag, spark)
    assert "docker/install-mac.sh mac-1" in start
    assert "docker compose -f docker/compose.yaml" in start


def test_api_keys_warning_names_only_the_gateway(tmp_path):
    r = run("config", "check", str(site_copy(tmp_path, secrets=False)), "--json", cwd=tmp_path)
    warnings = json.loads(r.stdout)["warnings"]
    keys = next(w for w in warnings if w.startswith("auth.api_keys_file"))
    secret = next(w for w in warnings if w.startswith("auth.node_secret_file"))
    assert "on the gateway box," in keys and "every node" not in keys and "every machine" not in keys
    assert "the gateway box and every node" in secret


def test_inflight_bound_must_hold_one_full_context(tmp_path):
    """Where the model folder is here, its geometry says what one full-context transfer reserves on a Mac (float32):
    a bound below it would refuse the longest prompts on every decode node."""
    from stack import MODEL_DIR  # SmolLM2: 30 layers x 3 KV heads x 64 x 2 x 4 B = 45 KiB/token, 1.41 GiB at 32k

    def edit(t, inflight):
        return (t.replace('path = "/opt/disagg/models/gpt-oss-120b"', f'path = "{MODEL_DIR}"')
                .replace("max_inflight_bytes = 6710886400", f"max_inflight_bytes = {inflight}"))
    r = check(tmp_path, lambda t: edit(t, 2**30))
    assert r.returncode == 2
    assert "model 'gpt-oss:120b': a full-context prompt's KV is 1.41 GiB as float32 > kv.max_inflight_bytes 1.00" \
        in r.stdout, r.stdout
    assert check(tmp_path, lambda t: edit(t, 6710886400)).returncode == 0


def site_geometry(tmp_path, dtype: str = "bfloat16") -> dict:
    """The site's two models as their config.json says (geometry only): Qwen3-Coder-30B-A3B and gpt-oss-120b."""
    out = {}
    for name, cfg in (("qwen3-coder-30b-a3b", {"model_type": "qwen3_moe", "num_hidden_layers": 48,
                                               "num_key_value_heads": 4, "num_attention_heads": 32, "head_dim": 128,
                                               "hidden_size": 2048}),
                      ("gpt-oss-120b", {"model_type": "gpt_oss", "num_hidden_layers": 36, "num_key_value_heads": 8,
                                        "num_attention_heads": 64, "head_dim": 64, "hidden_size": 2880,
                                        "sliding_window": 128})):
        folder = tmp_path / "models" / name
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({**cfg, "torch_dtype": dtype}))
        out[name] = folder
    return out


def test_config_check_shows_each_models_kv_in_flight_in_its_dtype(tmp_path):
    """A Mac holds bridged KV in the model's dtype (bf16 here): 96 KiB/token for Qwen3-Coder, 72 for gpt-oss; the
    site's 6.25 GiB in flight holds two full 32k contexts of either (3.0 / 2.25 GiB each), where float32 held one."""
    folders = site_geometry(tmp_path)

    def edit(t):
        for name, folder in folders.items():
            t = t.replace(f'path = "/opt/disagg/models/{name}"', f'path = "{folder}"')
        return t
    r = check(tmp_path, edit, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    cap = {c["model"]: c for c in json.loads(r.stdout)["kv_capacity"]}
    assert cap["qwen3-coder:30b"]["dtype"] == cap["gpt-oss:120b"]["dtype"] == "bfloat16"
    qwen, oss = cap["qwen3-coder:30b"], cap["gpt-oss:120b"]
    assert qwen["bytes_per_token"] == 96 * 1024 and oss["bytes_per_token"] == 72 * 1024
    assert qwen["full_context_in_flight"] == oss["full_context_in_flight"] == 2
    text = check(tmp_path, edit).stdout
    assert "qwen3-coder:30b: 96 KiB/token (bfloat16); a full context (32768 tokens) is 3.00 GiB: 2 at once" in text
    folders = site_geometry(tmp_path / "f32", "float32")  # a float32 checkpoint is held as float32: twice the bytes
    r = check(tmp_path, edit, "--json")
    cap = {c["model"]: c for c in json.loads(r.stdout)["kv_capacity"]}
    assert cap["qwen3-coder:30b"]["bytes_per_token"] == 192 * 1024
    assert cap["qwen3-coder:30b"]["full_context_in_flight"] == 1
