"""`disagg config check` against docker/ (backends/cli/deploy_check.py): the shipped compose file and Prometheus
config agree with the seeds' site file, and each port they name that the config does not (an unpublished gateway port,
a health check or scrape target on the old port, a proxied port with keyless networks) fails the check."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from tests.support import ROOT
from tests.support.cli import run

SEEDS = ROOT / "examples" / "site-seeds.toml"


def docker_copy(tmp_path: Path, edit=None, prom_edit=None) -> Path:
    """docker/'s compose file and Prometheus config in a folder of their own, each optionally edited as YAML."""
    out = tmp_path / "docker"
    (out / "prometheus").mkdir(parents=True)
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    prom = yaml.safe_load((ROOT / "docker" / "prometheus" / "prometheus.yml").read_text())
    if edit:
        edit(compose["services"])
    if prom_edit:
        prom_edit(prom["scrape_configs"])
    (out / "compose.yaml").write_text(yaml.safe_dump(compose))
    (out / "prometheus" / "prometheus.yml").write_text(yaml.safe_dump(prom))
    return out


def seeds(tmp_path: Path, old: str = "", new: str = "") -> Path:
    path = tmp_path / "config.toml"
    text = SEEDS.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return path


def check(tmp_path: Path, config: Path, docker: Path | None, *extra: str):
    args = ["config", "check", str(config), *extra] + (["--docker", str(docker)] if docker else [])
    return run(*args, cwd=tmp_path)


def test_the_shipped_docker_files_agree_with_the_seeds_site(tmp_path):
    r = check(tmp_path, SEEDS, ROOT / "docker")
    assert r.returncode == 0 and "config OK" in r.stdout, r.stdout + r.stderr
    assert "docker/compose.yaml not here" not in r.stdout


def test_run_from_the_repository_root_it_finds_docker_by_itself(tmp_path):
    shutil.copytree(ROOT / "docker", tmp_path / "docker")
    r = run("config", "check", str(seeds(tmp_path, "port = 8000", "port = 8080")), cwd=tmp_path)
    assert r.returncode == 2 and "Prometheus scrapes the gateway at 127.0.0.1:8000" in r.stdout, r.stdout


def test_a_gateway_port_the_compose_file_does_not_publish_fails(tmp_path):
    """The issue's case: a bridged gateway publishing 8000:8000 while the config also listens on Ollama's 11434."""
    def bridged(services):
        gw = services["gateway"]
        gw.pop("network_mode")
        gw["ports"] = ["8000:8000"]
    config = seeds(tmp_path, 'keyless_networks = ["169.254.150.0/24"]', "keyless_networks = []")
    r = check(tmp_path, config, docker_copy(tmp_path, bridged))
    assert r.returncode == 2, r.stdout
    assert "the gateway listens on 11434 (gateway.ollama_port) but the compose file does not publish it" in r.stdout
    # both published: the same compose file passes
    r = check(tmp_path, config, docker_copy(tmp_path / "b", lambda s: (bridged(s), s["gateway"]["ports"].append(
        "11434:11434"))))
    assert r.returncode == 0 and "config OK" in r.stdout, r.stdout


def test_keyless_networks_behind_a_published_port_fail(tmp_path):
    """Docker's userland proxy shows every client as the bridge's address: keyless needs host networking."""
    def bridged(services):
        services["gateway"].pop("network_mode")
        services["gateway"]["ports"] = ["8000:8000", "11434:11434"]
    r = check(tmp_path, SEEDS, docker_copy(tmp_path, bridged))
    assert r.returncode == 2 and "auth.keyless_networks needs the client's own address" in r.stdout, r.stdout


def test_a_health_check_or_scrape_target_on_another_port_fails(tmp_path):
    def old_probe(services):
        services["gateway"]["healthcheck"]["test"] = [
            "CMD", "python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"]
    config = seeds(tmp_path, "port = 8000", "port = 8080")
    r = check(tmp_path, config, docker_copy(tmp_path, old_probe))
    assert r.returncode == 2, r.stdout
    assert "health check probes port 8000, which the config does not listen on ([8080, 11434])" in r.stdout
    assert "Prometheus scrapes the gateway at 127.0.0.1:8000, but it listens on [8080, 11434]" in r.stdout


def test_an_environment_port_override_and_a_stale_node_target_fail(tmp_path):
    def env(services):
        services["gateway"]["environment"]["DISAGG_GATEWAY__PORT"] = "9000"

    def stale(scrape):
        scrape[1]["static_configs"][0]["targets"] = ["192.168.10.11:8100"]
    r = check(tmp_path, SEEDS, docker_copy(tmp_path, env, stale))
    assert r.returncode == 2, r.stdout
    assert "sets DISAGG_GATEWAY__PORT=9000 but the config says 8000" in r.stdout
    assert "node spark-1 is scraped at ['192.168.10.11:8100']" in r.stdout


def test_firewall_lines_come_from_the_config(tmp_path):
    r = check(tmp_path, SEEDS, ROOT / "docker", "--json")
    fw = json.loads(r.stdout)["firewall"]
    assert fw[0].startswith("  gateway (on spark-1): sudo ufw allow 8000/tcp; sudo ufw allow 11434/tcp")
    assert any("spark-2: sudo ufw allow from 169.254.150.103 to any port 8100 proto tcp" in line for line in fw)
    spark2 = [line for line in fw if line.startswith("  spark-2:")]
    assert "ufw allow OpenSSH" in spark2[0]  # SSH first: an admin who pastes the lines in order keeps the session
    assert any("from 169.254.150.101 to any port 8100" in line for line in spark2)  # a Mac's `disagg status`


def test_the_gateway_sharing_a_nodes_port_on_its_machine_fails(tmp_path):
    config = seeds(tmp_path, 'host = "169.254.150.103"\nport = 8100', 'host = "169.254.150.103"\nport = 11434')
    r = check(tmp_path, config, None)
    assert r.returncode == 2 and "spark-1 HTTP 169.254.150.103:11434 is also gateway's" in r.stdout, r.stdout
