"""`disagg config check` budgets each machine: a Mac's weights + prefix caches + in-flight KV + pool + a local prefill
+ MLX's cache + the process + a session against its RAM,
a Spark's vLLM share against what vLLM finds free at start, model folders against disk; and prints how each role
starts (the prefill container's run flags, the Mac install script)."""

from __future__ import annotations

import json
import re

from tests.support.cli import run
from tests.support.cli import ROOT, SITE, site_copy


def check(tmp_path, edit=lambda t: t, *extra):
    r = run("config", "check", str(site_copy(tmp_path, edit=edit)), *extra, cwd=tmp_path)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def test_site_defaults_fit_a_128g_spark_and_a_128g_mac(tmp_path):
    r = check(tmp_path, lambda t: t, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["errors"] == []
    by = {b["node"]: b for b in out["budgets"]}
    assert set(by) == {"spark-0", "spark-1", "mac-0", "mac-1"}
    mac = by["mac-0"]
    assert set(mac["memory_gib"]) == {"qwen3-coder:30b weights", "gpt-oss:120b weights", "prefix caches (2 models)",
                                      "in-flight KV", "receive pool", "local prefill", "MLX cache", "process",
                                      "session", "generated KV", "batch join copy"}
    assert 80 < sum(mac["memory_gib"].values()) <= mac["available_gib"] - 2.0 and mac["available_gib"] == 120
    assert mac["memory_gib"]["MLX cache"] == 0.5 and mac["memory_gib"]["session"] == 2.0
    assert mac["memory_gib"]["process"] == 0.75 + 2 * 0.5
    # no folder here: the declared sizes, and the note says so; the geometry is the published checkpoints'
    assert any(n.startswith("gpt-oss:120b weights: declared decode_weights_gib (no folder") for n in mac["notes"])
    assert any("openai/gpt-oss-120b's published config.json" in n for n in mac["notes"])
    assert sum(by["spark-1"]["memory_gib"].values()) <= by["spark-1"]["available_gib"] <= 102
    assert not [w for w in out["warnings"] if "not budgeted" in w or "_weights_gib" in w]


def old_site(t: str) -> str:
    """examples/site.toml before the honest budget, on the 96 GiB Macs it was written for: 1.5 GiB prefix per model,
    6.25 in flight, 0.75 pool, MLX's cache unbounded (counted at the new default, 1 GiB)."""
    return (t.replace("prefix_cache_bytes = 268435456", "prefix_cache_bytes = 1610612736")
            .replace("max_inflight_bytes = 4563402752", "max_inflight_bytes = 6710886400")
            .replace("pool_bytes = 536870912", "pool_bytes = 805306368")
            .replace("mlx_cache_limit_bytes = 536870912", "mlx_cache_limit_bytes = 1073741824")
            .replace("memory_gib = 128        # both models", "memory_gib = 96  # both models")
            .replace("memory_gib = 128\ndisk_gib = 900\n\n# ---- models", "memory_gib = 96\ndisk_gib = 900\n\n# ---- models"))


def test_the_old_site_budget_is_refused_now(tmp_path):
    """87.1 of 88 GiB before, counting weights, prefix, in-flight KV and pool only; with a local prefill of 32k tokens
    per model, MLX's cache, the process, a logged-in session, the answers' KV and the batch join copy it is 100.4:
    refused, saying what to lower."""
    r = check(tmp_path, old_site)
    assert r.returncode == 2, r.stdout
    err = [line for line in r.stdout.splitlines() if line.startswith("ERROR")]
    assert len(err) == 2 and all("decode node 'mac-" in e for e in err), err
    assert "needs 100.4 GiB" in err[0] and "but has 88.0 GiB" in err[0] and "12.4 GiB over" in err[0], err[0]
    for what in ("local prefill 1.6", "MLX cache 1.0", "process 1.8", "session 2.0", "in-flight KV 6.2",
                 "generated KV 1.8", "batch join copy 5.2"):
        assert what in err[0], (what, err[0])
    for fix in ("prefix_cache_bytes", "mlx_cache_limit_bytes", "max_inflight_bytes", "pool_bytes",
                "examples/site-paired.toml"):
        assert fix in err[0], (fix, err[0])


def on_96g_macs(t: str) -> str:
    return t.replace("memory_gib = 128        # both models", "memory_gib = 96  # both models").replace(
        "memory_gib = 128\ndisk_gib = 900\n\n# ---- models", "memory_gib = 96\ndisk_gib = 900\n\n# ---- models")


def test_site_toml_on_a_96g_mac_fails_with_the_answers_and_the_join_counted(tmp_path):
    """The issue's case: both models on a 96 GB Mac were "87.4 of 88.0 GiB, OK". Counted now: 4 answers of each model
    (its max_inflight) x 3,500 tokens of KV beyond the prompt (Qwen3-Coder 96 KiB/token, gpt-oss's 18 full layers
    36 KiB: its sliding layers add none) and the join's copy of a grading batch (one 25k + 3.5k-token Qwen3-Coder
    prompt: 2.61 GiB, more than gpt-oss's two at 1.97)."""
    r = check(tmp_path, on_96g_macs, "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 2 and len(out["errors"]) == 2, out["errors"]
    mac = next(b for b in out["budgets"] if b["node"] == "mac-0")
    qwen, oss = 48 * 4 * 128 * 2 * 2, 18 * 8 * 64 * 2 * 2  # bytes per generated token (gpt-oss: full layers only)
    assert abs(mac["memory_gib"]["generated KV"] - 4 * 3500 * (qwen + oss) / 2**30) < 1e-9
    assert abs(mac["memory_gib"]["batch join copy"] - 28500 * qwen / 2**30) < 1e-9
    assert "needs 91.8 GiB" in out["errors"][0] and "3.8 GiB over" in out["errors"][0]


def test_headroom_under_the_margin_fails(tmp_path):
    """Under memory_gib but within HEADROOM_GIB (2) of it: a failure that names the margin, not "OK"."""
    r = check(tmp_path, lambda t: on_96g_macs(t).replace("memory_gib = 96  # both models", "memory_gib = 101.5 #")
              .replace("memory_gib = 96\ndisk_gib = 900\n\n# ---- models", "memory_gib = 101.5\ndisk_gib = 900\n\n# -- models"))
    err = [line for line in r.stdout.splitlines() if line.startswith("ERROR")]
    assert r.returncode == 2 and len(err) == 2, r.stdout
    assert "needs 91.8 of its 93.5 GiB: 1.7 GiB headroom, under the 2 GiB margin" in err[0], err[0]


def test_over_budget_mac_is_refused(tmp_path):
    """16 GiB of prefix cache per model and 24 GiB in flight on a 96 GiB Mac."""
    r = check(tmp_path, lambda t: t.replace("prefix_cache_bytes = 268435456", "prefix_cache_bytes = 17179869184")
              .replace("max_inflight_bytes = 4563402752", "max_inflight_bytes = 25769803776"))
    assert r.returncode == 2, r.stdout
    err = [line for line in r.stdout.splitlines() if line.startswith("ERROR")]
    assert len(err) == 2 and all("decode node 'mac-" in e for e in err), err
    assert re.search(r"needs 1[0-9]{2}\.\d GiB .* but has 120\.0 GiB", err[0]), err[0]
    assert "prefix_cache_bytes" in err[0]


def test_bigger_mac_takes_the_old_defaults(tmp_path):
    r = check(tmp_path, lambda t: old_site(t).replace("prefix_cache_bytes = 1610612736", "prefix_cache_bytes = "
                                                      "17179869184").replace("memory_gib = 96", "memory_gib = 192"))
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
    r = check(tmp_path, lambda t: t.replace("memory_gib = 128\ndisk_gib = 900\n\n# ---- models",
                                            "memory_gib = 128\ndisk_gib = 60\n\n# ---- models"))
    assert r.returncode == 2
    assert "node 'mac-1': its model folders take 77.1 GiB" in r.stdout and "'mac-0'" not in r.stdout


def test_measured_folder_and_unknown_sizes(tmp_path):
    """A folder that is here is measured (for the side it is), declared size or not; else a warning names the field."""
    folder = tmp_path / "m"
    folder.mkdir()
    cfg = {"model_type": "llama", "num_hidden_layers": 36, "num_key_value_heads": 8, "head_dim": 64,
           "num_attention_heads": 64, "hidden_size": 2880, "quantization": {"bits": 4, "group_size": 64}}
    (folder / "config.json").write_text(json.dumps(cfg))
    with open(folder / "model.safetensors", "wb") as f:
        f.truncate(70 * 2**30)  # sparse: 70 GiB on paper
    edit = (lambda t: on_96g_macs(t).replace('path = "/opt/disagg/models/gpt-oss-120b"', f'path = "{folder}"')
            .replace("prefill_weights_gib = 60.8", ""))  # decode_weights_gib = 61.0 stays: the folder wins
    r = check(tmp_path, edit, "--json")
    out = json.loads(r.stdout)
    mac = next(b for b in out["budgets"] if b["node"] == "mac-0")
    assert mac["memory_gib"]["gpt-oss:120b weights"] == 70.0
    assert f"gpt-oss:120b weights: measured at {folder}" in mac["notes"]
    assert any(n.startswith("qwen3-coder:30b weights: declared") for n in mac["notes"])
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
    # SmolLM2: 30 layers x 3 KV heads x 64 x 2 x 4 B = 45 KiB/token, 1.41 GiB at 32k
    from tests.support.stack import MODEL_DIR

    def edit(t, inflight):
        return (t.replace('path = "/opt/disagg/models/gpt-oss-120b"', f'path = "{MODEL_DIR}"')
                .replace("max_inflight_bytes = 4563402752", f"max_inflight_bytes = {inflight}"))
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
                                               "hidden_size": 2048, "intermediate_size": 6144,
                                               "moe_intermediate_size": 768, "num_experts": 128,
                                               "num_experts_per_tok": 8}),
                      ("gpt-oss-120b", {"model_type": "gpt_oss", "num_hidden_layers": 36, "num_key_value_heads": 8,
                                        "num_attention_heads": 64, "head_dim": 64, "hidden_size": 2880,
                                        "intermediate_size": 2880, "num_local_experts": 128,
                                        "num_experts_per_tok": 4, "sliding_window": 128,
                                        "layer_types": ["sliding_attention", "full_attention"] * 18})):
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
        return (t.replace("max_inflight_bytes = 4563402752", "max_inflight_bytes = 6710886400")
                .replace("memory_gib = 96", "memory_gib = 192"))  # 6.25 GiB in flight: more than a 96 GiB Mac has
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


def test_local_prefill_peak_is_the_documented_formula():
    """docs/deploy.md's formula, by hand for Qwen3-Coder-30B-A3B (bf16, MoE 8 of 128 experts of 768, head_dim 128:
    Metal fuses the scores, so the chunk's bool mask over the whole KV counts) and for an unfused head_dim."""
    from backends.decode.budget import PUBLISHED, prefill_peak_bytes

    qwen, c, t = PUBLISHED["Qwen/Qwen3-Coder-30B-A3B-Instruct"], 2048, 32768
    per_token = 3 * 2048 + 2 * 32 * 128 + 2 * 4 * 128 + 8 * (2 * 2048 + 3 * 768)
    want = c * per_token * 2 + c * 128 * 4 + c * t + 2 * 4 * 128 * t * 2
    assert prefill_peak_bytes(qwen, t) == want  # 0.38 GiB
    dense = {"torch_dtype": "float32", "hidden_size": 4096, "num_hidden_layers": 2, "num_attention_heads": 16,
             "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 11008}
    per_token = 3 * 4096 + 2 * 16 * 256 + 2 * 4 * 256 + 3 * 11008
    want = 1000 * per_token * 4 + 16 * 1000 * 1000 * 4 + 2 * 4 * 256 * 1000 * 4  # scores materialized, float32
    assert prefill_peak_bytes(dense, 1000) == want  # a prompt shorter than a chunk is one chunk


def test_mlx_cache_limit_is_counted_and_is_mlx_api(tmp_path):
    import mlx.core as mx

    prev = mx.set_cache_limit(1 << 30)  # the call the decode node makes at start (backends/decode/node.py)
    mx.set_cache_limit(prev)
    r = check(tmp_path, lambda t: t.replace("mlx_cache_limit_bytes = 536870912", "mlx_cache_limit_bytes = 0"),
              "--json")
    mac = next(b for b in json.loads(r.stdout)["budgets"] if b["node"] == "mac-0")
    assert mac["memory_gib"]["MLX cache"] == 0


PAIRED = ROOT / "examples" / "site-paired.toml"


def capacity_of(path, tmp_path):
    """A site file through config check: (returncode, its JSON, {(node, model): grading capacity}, its text)."""
    from tests.support.cli import write

    tmp_path.mkdir()
    cfg = write(tmp_path, path.read_text(), path.name)
    (tmp_path / "node-secret").write_text("0123456789abcdef0123456789abcdef\n")
    (tmp_path / "api-keys").write_text("sk-grader-0123456789\n")
    js = run("config", "check", str(cfg), "--json", cwd=tmp_path)
    text = run("config", "check", str(cfg), cwd=tmp_path).stdout
    out = json.loads(js.stdout)
    cap = {(c["node"], c["model"]): c for b in out["budgets"] for c in b.get("grading_capacity", [])}
    return js.returncode, out, cap, text


def test_both_site_files_fit_and_say_how_many_grading_prompts_each_mac_holds(tmp_path):
    """site.toml (both models on both Macs) and site-paired.toml (one per Mac) pass; each Mac's capacity is the
    receive reservation (25k - 1 tokens, every layer at full length, bf16) against kv.max_inflight_bytes, capped by
    max_batch_size: the arithmetic by hand below."""
    from kv_bridge.config.settings import load_config

    qwen, oss = 48 * 4 * 128 * 2 * 2 * 24999, 36 * 8 * 64 * 2 * 2 * 24999  # 2.29 and 1.72 GiB
    for path, pairs in ((SITE, {("mac-0", "qwen3-coder:30b"), ("mac-0", "gpt-oss:120b"), ("mac-1", "qwen3-coder:30b"),
                                ("mac-1", "gpt-oss:120b")}),
                        (PAIRED, {("mac-0", "qwen3-coder:30b"), ("mac-1", "gpt-oss:120b")})):
        rc, out, cap, text = capacity_of(path, tmp_path / path.stem)
        assert rc == 0 and out["errors"] == [], (path, out["errors"])
        assert set(cap) == pairs
        s = load_config(path)
        for (node, model), c in cap.items():
            reserved = qwen if model.startswith("qwen") else oss
            assert c["reserved_gib"] == round(reserved / 2**30, 3) and c["dtype"] == "bfloat16"
            assert c["at_once"] == min(s.kv.max_inflight_bytes // reserved, s.decode.max_batch_size)
            assert (f"{model}: {c['at_once']} at once of 25000-token grading prompts ({reserved / 2**30:.2f} GiB "
                    f"reserved each, bfloat16, every layer at full length") in text
        if path == PAIRED:
            assert cap["mac-0", "qwen3-coder:30b"]["at_once"] == 3 and cap["mac-1", "gpt-oss:120b"]["at_once"] == 4
            # gpt-oss's 18 sliding layers keep 128 tokens once decoding: half the reservation is held
            assert cap["mac-1", "gpt-oss:120b"]["held_gib"] == round((18 * 25000 + 18 * 128) * 8 * 64 * 4 / 2**30, 3)
        else:
            assert (cap["mac-0", "qwen3-coder:30b"]["at_once"], cap["mac-0", "gpt-oss:120b"]["at_once"]) == (1, 2)
            assert "one of each model at once: 4.01 GiB reserved of the in-flight 4.25: fits" in text


def test_deploy_guides_table_is_what_config_check_prints(tmp_path):
    """docs/deploy.md "Which site file": each row's memory and prompts at once, as config check computes them."""
    guide = (ROOT / "docs" / "deploy.md").read_text()
    section = guide[guide.index("### Which site file"):]
    section = section[:section.index("\n#", 1)]  # that section's table only (section 9 has one of site files too)
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| site")]
    assert len(rows) == 3, rows
    for path in (SITE, PAIRED):
        _, out, cap, _ = capacity_of(path, tmp_path / path.stem)
        for b in (b for b in out["budgets"] if b["node"].startswith("mac")):
            row = next(r for r in rows if r[0].strip() == path.name and b["node"] in r[1])
            assert row[2].strip() == f"{sum(b['memory_gib'].values()):.1f}", (row, b)
            for col, model in ((3, "qwen3-coder:30b"), (4, "gpt-oss:120b")):
                c = cap.get((b["node"], model))
                assert row[col].strip() == (str(c["at_once"]) if c else "-"), (row, model)
