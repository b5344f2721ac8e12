"""The seed site on this machine as `make site` starts it (examples/site-local.toml, backends/site/launch.py), its two
models and the grading prompts the lab's app sends: test_site_e2e and bench/bench_site.py."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.support import ROOT
from tests.support.stack import POLL_S

CONFIG = ROOT / "examples" / "site-local.toml"
ROLES = ["spark-0", "spark-1", "mac-0", "mac-1", "link-mac-0", "link-mac-1", "gateway"]
SMOL, OSS = "smollm2:135m", "gpt-oss:tiny"
GATEWAY = "http://127.0.0.1:8000"
RUBRIC = ("You grade a student's notebook against the rubric. Answer with pure JSON only: "
          '{"score": <0-10>, "comment": "<one short sentence>"}.\nRubric: correctness, clarity, tests.\nNotebook:\n')
CELL = ("def mean(xs):\n    # average of a list of numbers, checked against numpy in the next cell\n"
        "    return sum(xs) / len(xs)\n\nassert mean([1, 2, 3]) == 2\nprint('cell ok', mean([4, 5, 6]))\n\n")


def notebook(cells: int, tag: str) -> str:
    """A grading prompt: the rubric and a notebook of `cells` cells (about 55 tokens each), unique per tag."""
    return RUBRIC + f"# student {tag}\n" + CELL * cells


class Site:
    """`python -m backends.site.launch` as a user starts it; Ctrl-C (SIGINT) stops it."""

    def __init__(self, folder: Path):
        from kv_bridge.config.settings import load_config

        self.log = folder / "site.out"
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, "-m", "backends.site.launch", "--config", str(CONFIG)], cwd=ROOT,
                                     stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.t0 = time.monotonic()
        self.ready_s = self._wait_output("disagg up: ready", 900)
        self.settings = load_config(CONFIG)
        self.key = self.settings.auth.client_keys()[0]

    def _wait_output(self, text: str, timeout: float, after: int = 0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if text in self.output()[after:]:
                return time.monotonic() - self.t0
            if self.proc.poll() is not None:
                raise AssertionError(f"the site exited ({self.proc.returncode}):\n{self.output()[-4000:]}")
            time.sleep(POLL_S)
        raise AssertionError(f"no {text!r} after {timeout:.0f}s:\n{self.output()[-4000:]}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def pid(self, name: str) -> int:
        return int(re.findall(rf"(?:started|restarted) {re.escape(name)} \(pid (\d+)\)", self.output())[-1])

    def kill(self, name: str) -> None:
        """kill -9 a machine: its role's whole process group."""
        os.killpg(self.pid(name), signal.SIGKILL)

    def wait_back(self, name: str, since: int) -> None:
        self._wait_output(f"disagg up: {name} is back", 600, after=since)

    def link(self, node: str, action: str, method: str = "POST") -> dict:
        n = self.settings.node(node)
        url = f"http://{n.kv_advertise_host}:{self.settings.site.control_port}/{action}"
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10) as r:
            return json.loads(r.read())

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def running_site(folder: Path):
    """The site up for the block; then Ctrl-C, which must exit 0 having said so and leave no role's process group."""
    s = Site(folder)
    try:
        yield s
    finally:
        groups = {name: s.pid(name) for name in ROLES}
        rc = s.stop()
    assert rc == 0, s.output()[-4000:]
    assert "disagg up: stopped" in s.output()
    alive = [name for name, pid in groups.items() if _group_alive(pid)]
    assert not alive, f"Ctrl-C left {alive} running"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


# Ollama's format as a JSON schema, bounded: `"json"` alone lets a 135M (or random) model open a string it never
# closes within num_predict; the schema makes every answer a whole JSON object in a few tokens.
VERDICT = {"type": "object", "properties": {"score": {"type": "integer", "minimum": 0, "maximum": 10},
                                            "verdict": {"enum": ["pass", "fail"]}},
           "required": ["score", "verdict"], "additionalProperties": False}
