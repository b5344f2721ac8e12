"""A second gateway process over a running site's nodes, on a free loopback port, for a bench to compare against the
first: `disagg bench grading --baseline mac-alone` (its models without prefill nodes: Ollama's way, every prompt on its
Mac) and bench/bench_queue_burst.py (a narrower queue, through `env`: DISAGG_GATEWAY__QUEUE__MAX_QUEUED)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class SecondGateway:
    def __init__(self, config: Path | str, log: Path, *, mac_alone: bool = False,
                 env: dict[str, str] | None = None) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log
        code = "import sys; from backends.site.second_gateway import serve; serve(sys.argv[1], int(sys.argv[2]), sys.argv[3])"
        self.log = open(log, "wb")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(config), str(port), "1" if mac_alone else ""],
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **(env or {})})

    def wait(self, timeout: float = 120.0) -> "SecondGateway":
        """Until its /health answers; a RuntimeError naming its log if it exits or does not answer in `timeout`."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the second gateway exited ({self.proc.returncode}); see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the second gateway did not answer /health in {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def __enter__(self) -> "SecondGateway":
        return self.wait()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(config: str, port: int, mac_alone: str = "") -> None:
    from gateway.app import serve as serve_gateway
    from kv_bridge.config.settings import load_config

    s = load_config(config)
    models = [m.model_copy(update={"prefill": []}) for m in s.models] if mac_alone else s.models
    serve_gateway(s.model_copy(update={"gateway": s.gateway.model_copy(update={"host": "127.0.0.1", "port": port}),
                                       "models": models}))
