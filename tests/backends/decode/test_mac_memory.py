"""The decode node's start-up check on a Mac: its models and their KV budget (config check's) against Metal's GPU
wired limit (`iogpu.wired_limit_mb`, 0 after every boot: about 75% of RAM). Runs here with a fake sysctl."""

from __future__ import annotations


import pytest

from backends.decode import mac_memory
from kv_bridge.config.settings import load_config
from kv_bridge.config.source import ConfigError
from tests.support import ROOT

SITE = ROOT / "examples" / "site-paired.toml"  # the file that fits a 96 GiB Mac (site.toml: 128)
GIB = 2**30


def fake_sysctl(limit_mb: int, mem_gib: int = 96):
    return lambda name: {"iogpu.wired_limit_mb": f"{limit_mb}\n", "hw.memsize": f"{mem_gib * GIB}\n"}[name]


@pytest.fixture
def site(monkeypatch):
    monkeypatch.setenv("DISAGG_CONFIG", str(SITE))  # load_config sets it; keep it from leaking into other tests
    s = load_config(SITE)
    return s, s.node("mac-1")  # gpt-oss, the fuller Mac


def test_after_a_reboot_the_default_limit_is_too_small_and_the_node_refuses(site):
    s, mac = site
    with pytest.raises(ConfigError) as e:
        mac_memory.check_decode_start(s, mac, SITE, sysctl=fake_sysctl(0), platform="darwin")
    msg = str(e.value)
    assert "72.0 GiB of 96 GiB" in msg and "macOS default" in msg
    assert "sudo sysctl iogpu.wired_limit_mb=90112" in msg and mac_memory.DAEMON in msg
    assert "gpt-oss:120b weights 61.0" in msg and "in-flight KV 8.0" in msg
    # the start-up refusal counts what config check counts: local prefill, MLX's cache, the process, a session
    assert all(f"{what} " in msg for what in ("local prefill", "MLX cache", "process", "session", "generated KV",
                                              "batch join copy")), msg


def test_the_install_scripts_limit_fits_the_site_budget(site):
    s, mac = site
    mac_memory.check_decode_start(s, mac, SITE, sysctl=fake_sysctl(90112), platform="darwin")
    ok, line = mac_memory.fit(s, mac, SITE, mac_memory.wired_limit(fake_sysctl(90112), "darwin"))
    assert ok and "88.0 GiB of 96 GiB (iogpu.wired_limit_mb = 90112)" in line


def test_a_mac_too_small_for_the_budget_is_told_what_to_lower(site):
    s, mac = site
    with pytest.raises(ConfigError) as e:
        mac_memory.check_decode_start(s, mac, SITE, sysctl=fake_sysctl(0, mem_gib=64), platform="darwin")
    assert "lower [decode] prefix_cache_bytes" in str(e.value) and "sudo sysctl" not in str(e.value)


def test_not_a_mac_no_wired_limit(site):
    s, mac = site
    assert mac_memory.wired_limit(fake_sysctl(0), "linux") is None
    mac_memory.check_decode_start(s, mac, SITE, sysctl=fake_sysctl(0), platform="linux")  # nothing to check


def test_decode_start_refuses_before_loading_a_model(site, monkeypatch, capsys):
    """`disagg decode` on a Mac whose limit is the default exits 2 with the sysctl, before mlx is imported."""
    from backends.cli import main as cli

    monkeypatch.setattr(mac_memory, "wired_limit", lambda: mac_memory.WiredLimit(0, 96 * GIB))
    assert cli.main(["decode", "--config", str(SITE), "--node", "mac-1"]) == cli.EXIT_CONFIG
    assert "iogpu.wired_limit_mb=90112" in capsys.readouterr().err
