"""docker/: the compose file, Prometheus config and rules, Grafana provisioning and dashboard, the launchd service.

Prometheus files go through promtool, the compose file through Debian's docker-compose (`config` needs no
daemon), both images through hadolint, the install scripts through shellcheck (`make tools` installs them); the
dashboard and alert queries against the metric names a real gateway exports on /metrics.
"""

from __future__ import annotations

import json
import os
import plistlib
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.support.fakes import LONG_TEXT, chat_body
from tests.support.metrics_names import exported, queried_metrics
from tests.support import ROOT

DOCKER = ROOT / "docker"
SERVICE_KEYS = {"build", "image", "restart", "ports", "environment", "volumes", "command", "depends_on",
                "healthcheck", "secrets", "networks", "network_mode", "user", "entrypoint"}
HEAVY = ("torch", "vllm", "mlx")


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def tool(name: str, *args: str, ok: bool = True, **kw) -> subprocess.CompletedProcess:
    exe = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    assert exe, f"{name} is missing: `make tools` installs it"
    r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, **kw)
    if ok:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def promtool(*args: str) -> str:
    return tool("promtool", *args).stdout


def test_compose_config_validates(tmp_path):
    """docker-compose v1 (Debian's) parses and interpolates the file; Grafana refuses to come up without a password."""
    env = {"PATH": os.environ["PATH"], "GRAFANA_ADMIN_PASSWORD": "s3cret", "DISAGG_UID": "1000", "DISAGG_GID": "1000"}
    r = tool("docker-compose", "-f", str(DOCKER / "compose.yaml"), "config", cwd=tmp_path, env=env)
    cfg = yaml.safe_load(r.stdout)
    assert cfg["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "s3cret"
    assert cfg["services"]["gateway"]["user"] == "1000:1000"
    env.pop("GRAFANA_ADMIN_PASSWORD")
    r = tool("docker-compose", "-f", str(DOCKER / "compose.yaml"), "config", ok=False, cwd=tmp_path, env=env)
    assert r.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in r.stderr, r.stderr


@pytest.mark.parametrize("dockerfile", ["gateway.Dockerfile", "prefill.Dockerfile"])
def test_hadolint(dockerfile):
    tool("hadolint", str(DOCKER / dockerfile))


def test_shellcheck_install_scripts():
    scripts = sorted(DOCKER.glob("*.sh"))
    assert DOCKER / "install-mac.sh" in scripts
    tool("shellcheck", *map(str, scripts))


def test_dockerignore_keeps_the_context_small():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "models", ".disagg", "docker/.env"} <= ignored
    for df in ("gateway.Dockerfile", "prefill.Dockerfile"):  # nothing an image COPYs is ignored
        for src in re.findall(r"^COPY (\S+)", (DOCKER / df).read_text(), re.M):
            assert src not in ignored, (df, src)


def test_install_mac_creates_what_launchd_needs():
    """launchd exits 78 when the log folder is missing: the script creates it, owned by the user, and the venv the
    plist runs."""
    plist = plistlib.loads((DOCKER / "launchd/com.disagg.decode.plist").read_bytes())
    script = (DOCKER / "install-mac.sh").read_text()
    assert Path(plist["StandardOutPath"]).parent.as_posix() == "/opt/disagg/logs"
    assert '"$PREFIX/logs"' in script and 'sudo install -d -o "$(id -un)"' in script
    assert plist["ProgramArguments"][0] == "/opt/disagg/.venv/bin/disagg" and '-m venv "$PREFIX/.venv"' in script
    assert "sys.version_info < (3, 11)" in script and "iogpu.wired_limit_mb" in script


def test_compose_services_and_paths():
    c = compose()
    assert set(c) <= {"version", "services", "volumes", "secrets", "networks"}  # no `name:`: compose v1 refuses it
    assert set(c["services"]) == {"gateway", "prometheus", "grafana"}
    for name, svc in c["services"].items():
        assert set(svc) <= SERVICE_KEYS, (name, set(svc) - SERVICE_KEYS)
        assert "image" in svc or "build" in svc, name
        for port in svc.get("ports", []):
            host, _, container = port.partition(":")
            assert 1 <= int(host) <= 65535 and 1 <= int(container) <= 65535, port
        for dep in svc.get("depends_on", []):
            assert dep in c["services"], (name, dep)
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):  # paths in the repo must exist; named volumes must be declared
                assert (DOCKER / src).exists(), (name, src)
            elif not src.startswith("/"):
                assert src in (c.get("volumes") or {}), (name, src)
    build = c["services"]["gateway"]["build"]
    assert (DOCKER / build["context"] / build["dockerfile"]).is_file()


def test_gateway_image_has_no_engine():
    """The gateway image installs the `gateway` extra only, and that extra pulls no torch, vLLM or MLX."""
    text = (DOCKER / "gateway.Dockerfile").read_text()
    assert re.search(r'pip install [^\n]*"\.\[gateway\]"', text)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not [d for d in extras["gateway"] if d.split(">")[0].split("=")[0].strip().startswith(HEAVY)]
    r = subprocess.run([sys.executable, "-c", "import sys, gateway.app; print(sorted({m.split('.')[0] for m in "
                        "sys.modules} & {'torch', 'vllm', 'mlx'}))"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr


def test_prefill_image_on_an_official_vllm_base():
    text = (DOCKER / "prefill.Dockerfile").read_text()
    base = re.search(r"^ARG BASE=(\S+)", text, re.M).group(1)
    assert base.startswith(("nvcr.io/nvidia/vllm:", "vllm/vllm-openai:")), base
    assert 'ENTRYPOINT ["disagg", "prefill"]' in text


def test_prefill_image_checks_its_platform_and_kernels_when_built():
    """Nothing assumed of the base tag: the build runs gpu_arch --build with Docker's TARGETARCH and the GB10's
    capability, after the project is installed (tests/backends/cli/doctor/test_gpu_arch.py tests the check)."""
    text = (DOCKER / "prefill.Dockerfile").read_text()
    assert "ARG TARGETARCH" in text and "ARG CUDA_CAPABILITY=12.1" in text
    run = text[text.index("RUN "):text.index("ENV ")]
    assert ('python3 -m backends.cli.doctor.gpu_arch --build --target-arch "${TARGETARCH}" --capability '
            '"${CUDA_CAPABILITY}"') in run
    assert run.index("pip install") < run.index("gpu_arch --build")


def test_prometheus_config_and_rules_validate():
    out = promtool("check", "config", str(DOCKER / "prometheus" / "prometheus.yml"))
    assert "SUCCESS" in out
    assert "5 rules found" in promtool("check", "rules", str(DOCKER / "prometheus" / "alerts.yml"))
    scrape = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    # Prometheus shares the gateway's machine and its host networking: the gateway on loopback at its own port
    assert scrape[0]["static_configs"][0]["targets"] == ["127.0.0.1:8000"]
    assert compose()["services"]["prometheus"]["network_mode"] == "host"


def test_prometheus_scrapes_every_node_of_the_site():
    """One target per [[nodes]] entry of examples/site-seeds.toml (the guide's main path) at its HTTP address,
    labelled with its name."""
    from kv_bridge.config.settings import load_config

    site = load_config(ROOT / "examples" / "site-seeds.toml")
    scrape = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    targets = {sc["labels"]["node"]: (job["job_name"], sc["targets"]) for job in scrape for sc in job["static_configs"]
               if "node" in sc.get("labels", {})}
    assert targets == {n.name: (f"disagg-{n.role}", [f"{n.host}:{n.port}"]) for n in site.nodes}
    # the dashboard has panels for each node family, grouped by that label
    assert queried_metrics("prefill") and queried_metrics("decode")
    dash = json.loads((DOCKER / "grafana/dashboards/disagg.json").read_text())
    for p in dash["panels"]:
        for t in p["targets"]:
            if re.search(r"vllm:|disagg_decode_", t["expr"]):
                assert "by (node" in t["expr"], (p["title"], t["expr"])


def test_grafana_provisioning():
    ds = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yaml").read_text())["datasources"][0]
    assert ds["url"] == "http://127.0.0.1:9090"  # both on host networking (compose.yaml)
    dash = json.loads((DOCKER / "grafana/dashboards/disagg.json").read_text())
    for panel in dash["panels"]:
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == ds["uid"], panel["title"]
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for want in ("first token", "inter-token", "kv bytes", "kv transfer", "path mix", "fallbacks", "nodes up",
                 "requests running"):
        assert want in titles, want


async def test_dashboard_queries_only_exported_metrics(cluster):
    await cluster.chat(chat_body(LONG_TEXT, max_tokens=4))  # a disaggregated request: every family has samples
    async with cluster.http.get(f"{cluster.url}/metrics") as r:
        have = exported(await r.text())
    missing = {n: sorted(w) for n, w in queried_metrics("gateway").items() if n not in have}
    assert not missing, f"queried but not exported by the gateway: {missing}"


def test_unknown_metric_is_caught():
    """The check above fails on a name the gateway does not export (guards the parser itself)."""
    have = exported("# TYPE disagg_requests_total counter\n# TYPE disagg_x_seconds histogram\n")
    assert {"disagg_requests_total", "disagg_x_seconds_bucket"} <= have
    assert not {"disagg_requests_total_total", "disagg_requests_bogus", "disagg_x_seconds"} & have


def test_launchd_service_runs_decode():
    plist = plistlib.loads((DOCKER / "launchd/com.disagg.decode.plist").read_bytes())
    args = plist["ProgramArguments"]
    assert args[0].endswith("/disagg") and args[1] == "decode"
    assert args[args.index("--node") + 1] == "NODE_NAME"  # docs/deploy.md: sed it to the Mac's node name
    assert plist["RunAtLoad"] is True and plist["KeepAlive"] == {"SuccessfulExit": False}


def test_decode_service_is_a_launch_daemon_that_survives_a_logout():
    """Installed in the system domain (/Library/LaunchDaemons, root-owned), run as the installing user (UserName):
    it starts at boot and keeps running with nobody logged in. An old LaunchAgent is stopped and removed."""
    plist = plistlib.loads((DOCKER / "launchd/com.disagg.decode.plist").read_bytes())
    assert plist["UserName"] == "USER_NAME" and plist["EnvironmentVariables"]["HOME"] == "USER_HOME"
    script = (DOCKER / "install-mac.sh").read_text()
    assert "SERVICE=/Library/LaunchDaemons/com.disagg.decode.plist" in script
    assert 'sudo install -o root -g wheel -m 644 "$tmp" "$SERVICE"' in script
    assert 'sudo launchctl bootstrap system "$SERVICE"' in script
    assert '-e "s/USER_NAME/$(id -un)/"' in script and '-e "s#USER_HOME#$HOME#"' in script
    # the only gui/ (session) domain use left: removing an agent installed before
    assert [line.strip() for line in script.splitlines() if "gui/" in line] == [
        'launchctl bootout "gui/$(id -u)/com.disagg.decode" 2>/dev/null || true']
    assert "LaunchAgents/com.disagg.decode" not in (ROOT / "docs" / "deploy.md").read_text()


@pytest.mark.parametrize("path", sorted(p.relative_to(DOCKER).as_posix() for p in DOCKER.rglob("*.y*ml")))
def test_yaml_parses(path):
    assert yaml.safe_load((DOCKER / path).read_text())


def test_wired_limit_is_set_at_every_boot():
    """The LaunchDaemon the install script installs sets Metal's wired limit before anyone logs in (it resets to 0,
    about 75% of RAM, at boot); the value is the Mac's RAM less config check's 8 GiB reserve."""
    daemon = plistlib.loads((DOCKER / "launchd/com.disagg.wired-limit.plist").read_bytes())
    assert daemon["ProgramArguments"] == ["/usr/sbin/sysctl", "iogpu.wired_limit_mb=WIRED_LIMIT_MB"]
    assert daemon["RunAtLoad"] is True and "KeepAlive" not in daemon
    script = (DOCKER / "install-mac.sh").read_text()
    assert 'sed "s/WIRED_LIMIT_MB/$limit_mb/" "$LIMIT_SRC"' in script
    assert 'sudo install -o root -g wheel -m 644 "$tmp" "$DAEMON"' in script
    assert "DAEMON=/Library/LaunchDaemons/com.disagg.wired-limit.plist" in script
    assert 'sudo launchctl bootstrap system "$DAEMON"' in script
    assert 'limit_mb=$(( (mem_gib - RESERVED_GIB) * 1024 ))' in script and 'RESERVED_GIB="${RESERVED_GIB:-8}"' in script
    from backends.decode.mac_memory import DAEMON as CHECKED  # the path the decode node's refusal names

    assert f"DAEMON={CHECKED}" in script


def test_decode_log_is_rotated():
    """newsyslog rotates the file the node logs to (reopened on rename: no signal) and launchd's stdout file."""
    plist = plistlib.loads((DOCKER / "launchd/com.disagg.decode.plist").read_bytes())
    rows = [line.split() for line in (DOCKER / "launchd/com.disagg.decode.newsyslog.conf").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert {r[0] for r in rows} == {plist["EnvironmentVariables"]["DISAGG_LOG_FILE"], plist["StandardOutPath"]}
    for path, owner, mode, count, size, when, flags in rows:
        assert owner == "USER:staff" and int(mode, 8) == 0o644 and int(count) > 0 and int(size) > 0
        assert "N" in flags  # no process to signal: the handler reopens decode.log itself
    assert 'sed "s/USER:/$(id -un):/" "$ROTATE_SRC"' in (DOCKER / "install-mac.sh").read_text()


def test_log_file_handler_reopens_after_rotation(tmp_path):
    """DISAGG_LOG_FILE: after newsyslog renames decode.log, the next line lands in a new decode.log."""
    log = tmp_path / "decode.log"
    code = ("import logging, os, sys; from backends.cli import main as cli; "
            "sys.exit(cli.main(['config', 'check', '/nonexistent.toml']) and "
            "(os.rename(sys.argv[1], sys.argv[1] + '.0'), logging.getLogger('x').warning('after'), 0)[2])")
    r = subprocess.run([sys.executable, "-c", code, str(log)], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "DISAGG_LOG_FILE": str(log)})
    assert r.returncode == 0, r.stderr
    assert "after" in log.read_text() and (tmp_path / "decode.log.0").exists()


def test_seeds_file_comments_agree_with_the_file(tmp_path):
    """examples/site-seeds.toml's comments: the machine table (address, role, model, node) is its [[nodes]] and
    [[models]] routes; each Mac's memory figure and vLLM's share are what config check computes from it."""
    from kv_bridge.config.settings import load_config
    from tests.support.cli import run as disagg

    path = ROOT / "examples" / "site-seeds.toml"
    text, site = path.read_text(), load_config(path)
    rows = re.findall(r"^#\s+(?:Mac Studio|DGX Spark) \d\s+(\S+)\s+(decode|prefill) (\S+)\s+(\S+)", text, re.M)
    assert len(rows) == len(site.nodes) == 4, rows
    for host, role, model, name in rows:
        node = site.node(name)
        route = next(r for r in site.models if r.id == model)
        assert (node.host, node.role) == (host, role) and getattr(route, role) == [name], (name, model)
    out = json.loads(disagg("config", "check", str(path), "--json", cwd=tmp_path).stdout)
    said = " ".join(line.split("#", 1)[1].strip() for line in text.splitlines() if "#" in line)  # comments, joined
    for b in out["budgets"]:
        total = sum(b["memory_gib"].values())
        if b["node"].startswith("mac"):
            assert re.search(rf"{b['node']}\b[^.;]*? in {total:.1f} of the 88 GiB|{b['node']} \S+ in {total:.1f}\b",
                             said), (b["node"], total)
        else:
            assert f"{total:g} of 102 GiB" in said, (b["node"], total)  # config check's share of memory_gib 128
    share = site.prefill.gpu_memory_utilization
    assert f"{share:g} asks {round(share * 121.7)} GiB" in said  # what vLLM asks of the 121.7 GiB a GB10 reports
    assert "87.4" not in said and "both models on each Mac" not in said
