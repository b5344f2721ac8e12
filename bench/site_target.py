"""What bench_split, bench_long, bench_threshold (and the others with `--config`) measure: their own embedded stack (the
default), or a running site from its config (`--config F [--model ID] [--gateway URL]`, run on the gateway's machine):
the gateway's URL and a client key, a prefill and a decode node of the model with the node token and KV key, and the
model's tokenizer (the gateway's copy). Nothing is started on the site; bench_threshold starts its gateways on this
machine, against the site's nodes."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", type=Path, help="measure the running site this config describes (from the gateway's "
                    "machine: the node secret, a client key and the model's tokenizer folder are read from it) "
                    "instead of starting an embedded stack")
    ap.add_argument("--model", help="with --config: the model id to measure (default: the config's first)")
    ap.add_argument("--gateway", help="with --config: the gateway's URL (default: [gateway] host:port, 0.0.0.0 as "
                    "127.0.0.1)")
    ap.add_argument("--api-key", help="with --config: a client key (default: $DISAGG_API_KEY, else the config's)")


@dataclass
class Target:
    """One model on one deployment: the URLs a bench sends to, each with its credentials. `url(name)` and
    `headers(name)` take "gateway", "prefill-0" or "decode-0" (the embedded stack's names; on a site, the model's first
    prefill and decode node)."""

    model: str
    urls: dict[str, str]
    headers_by: dict[str, dict] = field(default_factory=dict)
    tokenizer_dir: Path = ROOT
    max_model_len: int = 4096
    config: Path | None = None
    nodes: dict[str, str] = field(default_factory=dict)  # "prefill-0"/"decode-0" -> the site's node name
    live: bool = False  # a site measured as it runs (its settings are its own: the bench cannot change them)
    min_disagg_tokens: int = 8  # the model's threshold: a split measurement needs a prompt at least this long
    wire: str = "float32"  # [kv] wire_dtype of the deployment
    kv_key: bytes | None = None  # what a KV receiver of its prefill nodes checks streams with (None: open)
    kv_frame_mac: bool = True

    def url(self, name: str) -> str:
        return self.urls[name]

    def headers(self, name: str) -> dict:
        return self.headers_by.get("gateway" if name == "gateway" else "node", {})

    def describe(self) -> str:
        where = f"the running site of {self.config}" if self.live else "an embedded stack (SmolLM2, this machine)"
        names = ", ".join(f"{k} = {v}" for k, v in self.nodes.items())
        return f"{where}: model {self.model}, gateway {self.urls['gateway']}" + (f", {names}" if names else "")


def gateway_url(settings) -> str:
    h = settings.gateway.host
    return f"http://{'127.0.0.1' if h in ('0.0.0.0', '::', '') else h}:{settings.gateway.port}"


def site(config: Path, model: str | None = None, gateway: str | None = None, api_key: str | None = None) -> Target:
    """The Target of a running site, from its config; SystemExit with the fix when something it needs is missing."""
    from backends.cli.status import client_key
    from kv_bridge.config.models import resolve_model_path
    from kv_bridge.config.settings import load_config
    from kv_bridge.config.source import ConfigError

    try:
        s = load_config(config)
        token = s.auth.node_token()
    except ConfigError as e:
        raise SystemExit(f"bench: {e}") from None
    route = next((m for m in s.models if model in (None, m.id)), None)
    if route is None:
        raise SystemExit(f"bench: --model {model!r} is not in {config}; known: {[m.id for m in s.models]}")
    if not route.prefill:
        raise SystemExit(f"bench: {route.id} has no prefill node in {config}: nothing to split")
    folder = resolve_model_path(route, config.resolve().parent)
    if not (folder / "tokenizer.json").is_file():
        raise SystemExit(f"bench: no tokenizer at {folder}: run on the gateway's machine (its copy of the model), or "
                         f"`disagg models prepare --role gateway` here")
    key = client_key(s, api_key)
    nodes = {"prefill-0": route.prefill[0], "decode-0": route.decode[0]}
    urls = {"gateway": gateway or gateway_url(s)} | {k: s.node(v).url for k, v in nodes.items()}
    headers = {"gateway": key.headers, "node": {"Authorization": f"Bearer {token}"} if token else {}}
    return Target(route.id, urls, headers, folder, route.max_model_len, config, nodes, live=True,
                  min_disagg_tokens=route.min_disagg_tokens, wire=s.kv.wire_dtype, kv_key=s.auth.kv_key(),
                  kv_frame_mac=s.auth.kv_frame_mac)


def running_prefill(config: Path, model: str) -> tuple[int, str]:
    """(port, node secret) of a running stack's first prefill node for `model`, from its config: a bench's own decode
    node and gateway use it (tests/support/stack.py `Stack(prefill_port=..., node_secret=...)`, this machine)."""
    from kv_bridge.config.settings import load_config

    s = load_config(config)
    route = next((m for m in s.models if m.id == model and m.prefill), None)
    secret = s.auth.secret()
    if route is None or secret is None:
        raise SystemExit(f"bench: {config} has no prefill node for {model}, or no node secret")
    return s.node(route.prefill[0]).port, secret.decode()


@contextlib.contextmanager
def embedded(folder: Path, names=("decode-0", "prefill-0", "gateway"), env: dict | None = None,
             edit=None, **cfg) -> Iterator[tuple[Target, object]]:
    """The embedded stack (tests/support/stack.py) started in `folder`, as a Target (and the Stack itself)."""
    from kv_bridge.config.settings import load_config
    from tests.support.stack import MODEL_DIR, MODEL_ID, Stack

    stack = Stack(folder, **cfg)
    if edit is not None:
        stack.config.write_text(edit(stack.config.read_text()))
        stack.settings = load_config(stack.config)
    try:
        for name in names:
            stack.start(name, env=env)
        urls = {n: stack.url(n) for n in ("gateway", "prefill-0", "decode-0")}
        route = stack.settings.models[0]
        yield Target(MODEL_ID, urls, {"node": stack.node_headers}, MODEL_DIR, route.max_model_len, stack.config,
                     min_disagg_tokens=route.min_disagg_tokens, wire=(env or {}).get("DISAGG_KV__WIRE_DTYPE",
                                                                                     stack.settings.kv.wire_dtype)), stack
    finally:
        stack.stop()


def gateway_config(text: str, base: Path, port: int, min_disagg_tokens: int) -> str:
    """A site config for a bench's own gateway: [gateway] on 127.0.0.1:port, every model's min_disagg_tokens set,
    relative paths (model folders, secret files, state) made absolute against the config's folder `base`."""
    text = re.sub(r'(?m)^(\s*\w*(?:_file|_dir|path)\s*=\s*)"(?!/)([^"]*)"',
                  lambda m: f'{m.group(1)}"{os.path.normpath(base / m.group(2))}"', text)
    text = re.sub(r"(?m)^min_disagg_tokens\s*=.*\n", "", text)
    text = re.sub(r"(?m)^\[\[models\]\]\n", f"[[models]]\nmin_disagg_tokens = {min_disagg_tokens}\n", text)
    head, sep, rest = text.partition("[gateway]\n")
    if not sep:
        return f"[gateway]\nhost = \"127.0.0.1\"\nport = {port}\n\n" + text
    m = re.search(r"(?m)^\[", rest)  # the next table: [gateway]'s own keys end there
    body, tail = (rest[:m.start()], rest[m.start():]) if m else (rest, "")
    body = re.sub(r"(?m)^(host|port)\s*=.*\n", "", body)
    return head + sep + f'host = "127.0.0.1"\nport = {port}\n' + body + tail


def start_gateway(config: Path, folder: Path, min_disagg_tokens: int, headers: dict | None = None,
                  fidelity_wait_s: float = 0.0) -> tuple[subprocess.Popen, str]:
    """A gateway on this machine, on a free loopback port, in front of `config`'s nodes, with every model's
    min_disagg_tokens set (1: every prompt long enough to split; a huge one: every prompt local). `fidelity_wait_s`:
    wait up to that long for its KV canary's verdicts (only a verified pair takes the disaggregated path)."""
    from tests.support.stack import free_port, wait_http

    port = free_port()
    cfg = folder / f"gateway-{min_disagg_tokens}.toml"
    cfg.write_text(gateway_config(config.read_text(), config.resolve().parent, port, min_disagg_tokens))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_GATEWAY__")}
    log = open(folder / f"gateway-{min_disagg_tokens}.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "backends.cli.main", "gateway", "--config", str(cfg)], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 120, proc, headers)
    if fidelity_wait_s > 0:
        from backends.cli.status import await_fidelity
        from kv_bridge.config.settings import load_config

        names = {n.name for n in load_config(cfg).nodes}
        for line in await_fidelity(url + "/health", headers or {}, fidelity_wait_s, names):
            print(f"bench gateway {url}: {line}", flush=True)
    return proc, url
