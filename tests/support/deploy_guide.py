"""docs/deploy.md as pasted: its fenced blocks in order (```sh on=spark-1), their commands, and a static walk: each
`disagg` line against the CLI's parser, files, nodes and models against the seeds' file, launchctl domains against
the plist's kind, each tool on its machine in the order things exist there."""

from __future__ import annotations

import ipaddress
import re
import shlex
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import ROOT

GUIDE = ROOT / "docs" / "deploy.md"
SEEDS = ROOT / "examples" / "site-seeds.toml"
UPLINK = "uplink"  # a machine with an internet connection (section 0's offline route)
REPO_DIRS = ("docker", "examples", "docs", "tests", "backends", "bench", "gateway", "kv_bridge")
ENV = {"HOME", "USER", "PWD", "PATH"}
SHELL = {"for", "do", "done", "echo", "cd", "sync"}
# Each tool, by the machines it exists on: linux (the Sparks), mac, uplink; "any" for all.
TOOLS = {
    "linux": {"ip", "nmcli", "ufw", "systemctl", "usermod", "newgrp", "apt-get", "tee", "docker", "python3",
              "python3.12", "install", "cp", "chmod", "cat", "mkdir", "rm", "scp", "git", "curl", "grep", "head",
              "chown", "sysctl", "disagg", "id"},
    "mac": {"networksetup", "ifconfig", "brew", "launchctl", "/usr/libexec/ApplicationFirewall/socketfilterfw",
            "pmset", "ollama", "pgrep", "osascript", "ssh", "scp", "curl", "python3", "install", "cp", "chmod", "mkdir",
            "rm", "git", "grep", "docker/install-mac.sh", "sysctl", "open", "id"},
    UPLINK: {"docker", "python3.12", "hf", "git", "gzip", "scp"},
}


@dataclass
class Block:
    line: int
    lang: str
    machines: tuple[str, ...]
    text: str
    commands: list[str] = field(default_factory=list)


def blocks(text: str) -> list[Block]:
    """Every fenced block, in order; an indented code block (which this walk would not see) is an error."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\w*)(.*)$", lines[i])
        if not m:
            if re.match(r"^ {4,}\S", lines[i]) and i and not lines[i - 1].strip():
                raise ValueError(f"docs/deploy.md:{i + 1}: an indented code block: fence it with its machine")
            i += 1
            continue
        indent, lang, info = m.groups()
        on = re.search(r"\bon=(\S+)", info)
        if not on:
            raise ValueError(f"docs/deploy.md:{i + 1}: a ```{lang} block without on=MACHINE")
        body, i = [], i + 1
        while not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].strip())
            i += 1
        b = Block(i - len(body), lang, tuple(on.group(1).split(",")), "\n".join(body))
        b.commands = split(body) if lang == "sh" else []
        out.append(b)
        i += 1
    return out


def split(block: list[str]) -> list[str]:
    """A block's lines into commands: continuation lines and heredocs joined, comments off."""
    cmds, cur, heredoc = [], "", None
    for raw in block:
        line = raw.rstrip()
        if heredoc:
            cur += "\n" + line
            if line.strip() == heredoc:
                cmds.append(cur)
                cur, heredoc = "", None
            continue
        code = "" if line.lstrip().startswith("#") else re.sub(r"\s+#\s.*$", "", line).strip()
        if not code:
            continue
        cur = cur[:-1].rstrip() + " " + code if cur.endswith("\\") else code
        m = re.search(r"<<-?'?(\w+)'?$", cur)
        if m:
            heredoc = m.group(1)
        elif not cur.endswith("\\"):
            cmds.append(cur)
            cur = ""
    return cmds


def simple_commands(cmd: str) -> list[tuple[list[str], str]]:
    """(words, raw text) of each simple command in `cmd`: $(...) substitutions separately, then the pipeline split
    at ; | && ||, redirections dropped; a heredoc's body is not a command."""
    head, out = cmd.split("\n", 1)[0], []
    while "$(" in head:  # innermost-first is not needed: one level, parentheses inside counted
        start = head.index("$(")
        depth, end = 0, start + 1
        for end in range(start + 1, len(head)):
            depth += {"(": 1, ")": -1}.get(head[end], 0)
            if depth == 0:
                break
        out += simple_commands(head[start + 2:end])
        head = head[:start] + "SUBST" + head[end + 1:]
    lex = shlex.shlex(head, posix=True, punctuation_chars=";&|<>")
    lex.whitespace_split = True
    words, cur, skip = list(lex), [], False
    for w in words:
        if skip:
            skip = False
        elif w in (";", "|", "&&", "||", "&"):
            if cur:
                out.append((cur, " ".join(cur)))
            cur = []
        elif set(w) <= set("<>&") or re.fullmatch(r"\d[<>]+&?\d*", w):
            skip = True  # the redirection's target
        else:
            cur.append(w)
    if cur:
        out.append((cur, " ".join(cur)))
    return out


def used_vars(cmd: str) -> set[str]:
    head = cmd.split("\n", 1)[0] if re.search(r"<<'\w+'", cmd) else cmd
    return set(re.findall(r"\$\{?([A-Za-z_]\w*)", re.sub(r"'[^']*'", "", head))) - ENV


@dataclass
class Machine:
    """What exists on one machine at a point of the walk."""
    name: str
    kind: str
    made: set[str] = field(default_factory=set)  # opt, venv, repo-venv, docker-group, wrapper, image:NAME, ...
    vars: set[str] = field(default_factory=set)
    ufw: list[tuple[str, set[int]]] = field(default_factory=list)  # (source network, ports) allowed so far


class Walk:
    """The static walk: `check(block)` for each block in order; problems collects what is wrong, by line."""

    def __init__(self):
        from kv_bridge.config.settings import load_config

        self.settings = load_config(SEEDS)
        self.nodes = {n.name: n for n in self.settings.nodes}
        self.gateway_machine = next(n.name for n in self.settings.nodes if n.host == self.settings.gateway.reach_host())
        self.machines = {n: Machine(n, "linux" if self.nodes[n].role == "prefill" else "mac") for n in self.nodes}
        self.machines[UPLINK] = Machine(UPLINK, UPLINK)
        self.problems: list[str] = []
        self.checked = 0

    def check(self, b: Block) -> None:
        for name in b.machines:
            if name not in self.machines:
                self.problems.append(f"line {b.line}: on={name} is no machine of the seeds' file nor `{UPLINK}`")
                return
        for name in b.machines:
            m = self.machines[name]
            if b.lang == "toml":
                self._toml(b, m)
                continue
            for cmd in b.commands:
                before = len(self.problems)
                self.command(cmd, m)
                self.problems[before:] = [f"line {b.line} on {m.name}: {cmd.splitlines()[0][:80]}: {p}"
                                          for p in self.problems[before:]]
        self.checked += 1

    def _toml(self, b: Block, m: Machine) -> None:
        from kv_bridge.config.settings import load_config

        tomllib.loads(b.text)
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "config.toml"
            path.write_text(SEEDS.read_text() + "\n" + b.text + "\n")
            try:
                load_config(path)  # the config's own validation: names it does not have, an empty reason
            except Exception as e:  # noqa: BLE001 - reported as the block's problem
                self.problems.append(f"line {b.line}: does not load with the seeds' file: {e}")

    def command(self, cmd: str, m: Machine) -> None:
        if "launchctl bootout" in cmd and "&&" in cmd.split("launchctl bootout", 1)[1]:
            self.problems.append("chained after launchctl bootout: what follows never runs when bootout fails")
        for var in used_vars(cmd):
            if var not in m.vars:
                self.problems.append(f"${var} is not set by an earlier line on {m.name}")
        heredoc = cmd.split("\n", 1)[1] if "\n" in cmd else ""
        m.made |= {"file:" + t for t in re.findall(r"(?<![<\d])>\s*([\w./-]+)", cmd.split("\n", 1)[0])}
        for words, raw in simple_commands(cmd):
            self.simple(words, raw, m, heredoc)
        for p in re.findall(r"(?<![\w/.])((?:%s)/[\w./*-]+)" % "|".join(REPO_DIRS), cmd.split("\n", 1)[0]):
            if "*" not in p and not (ROOT / p.rstrip(".")).exists() and "file:" + p not in m.made:
                self.problems.append(f"{p}: no such file in the repository")

    def simple(self, words: list[str], raw: str, m: Machine, heredoc: str) -> None:
        sudo = words[0] == "sudo"
        words = words[1:] if sudo else words
        while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):  # assignments (alone, or before a command)
            name = words[0].split("=", 1)[0]
            words = words[1:]
            if not words:
                m.vars.add(name)
        if not words:
            return
        tool = words[0]
        if tool in SHELL:
            if tool == "for":
                m.vars.add(words[1])
            return
        if not self._exists(tool, words, m, sudo):
            return
        handler = getattr(self, "_" + re.sub(r"\W", "_", Path(tool).name), None)
        if handler:
            handler(words, m, sudo, heredoc)

    def _exists(self, tool: str, words: list[str], m: Machine, sudo: bool) -> bool:
        if tool.startswith("/opt/disagg/.venv/bin/"):
            ok = "venv" in m.made
            if ok and tool.endswith("/disagg"):
                self.disagg(words[1:], m)
            elif ok and tool.endswith("/hf"):
                self._hf(words, m, sudo, "")
            why = "the venv comes later (docker/install-mac.sh, or python3.12 -m venv)"
        elif tool.startswith(".venv/bin/"):
            ok, why = "repo-venv" in m.made, "no .venv made earlier on this machine"
            if ok and words[1:3] == ["-m", words[2]] and words[2].startswith("bench."):
                self._bench(words, m)
        elif tool not in TOOLS[m.kind]:
            ok, why = False, f"{tool} does not exist on {m.name} ({m.kind})"
        elif tool == "docker" and m.kind == "linux":
            ok, why = sudo or "docker-group" in m.made, "not in the docker group yet (usermod + newgrp) nor sudo"
        elif tool == "disagg":
            ok, why = "wrapper" in m.made, "no disagg on this machine yet (the wrapper of section 3)"
            if ok:
                self.disagg(words[1:], m)
        else:
            ok, why = True, ""
        if not ok:
            self.problems.append(why)
        return ok

    # ---- per tool ----

    def _install(self, words, m, sudo, heredoc):
        if "-d" in words and "/opt/disagg" in words:
            m.made.add("opt")

    def _usermod(self, words, m, sudo, heredoc):
        m.made.add("usermod-docker" if "docker" in words else "usermod")

    def _newgrp(self, words, m, sudo, heredoc):
        if "usermod-docker" in m.made and words[1:] == ["docker"]:
            m.made.add("docker-group")

    def _python3_12(self, words, m, sudo, heredoc):
        if words[1:3] == ["-m", "venv"]:
            m.made.add("venv" if words[3] == "/opt/disagg/.venv" else "repo-venv")

    def _tee(self, words, m, sudo, heredoc):
        if "/usr/local/bin/disagg" in words:
            if not re.search(r'--entrypoint disagg (\S+) "\$@"', heredoc):
                self.problems.append("the wrapper runs no disagg image")
            elif "image:" + re.search(r'--entrypoint disagg (\S+) "\$@"', heredoc).group(1) not in m.made:
                self.problems.append("the wrapper's image is not built or loaded yet")
            m.made.add("wrapper")

    def _install_mac_sh(self, words, m, sudo, heredoc):
        if words[1:] != [m.name]:
            self.problems.append(f"install-mac.sh {' '.join(words[1:])}: this Mac's node is {m.name}")
        m.made.add("venv")

    def _hf(self, words, m, sudo, heredoc):
        repo = words[2] if words[1] == "download" else None
        if m.kind != UPLINK and repo and not any(repo in r.aliases and m.name in (*r.prefill, *r.decode)
                                                 for r in self.settings.models):
            self.problems.append(f"hf download {repo}: not a checkpoint of a model {m.name} serves")

    def _ollama(self, words, m, sudo, heredoc):
        if words[1] == "stop":
            m.made.add("ollama-unloaded")

    def _brew(self, words, m, sudo, heredoc):
        if words[1:] == ["services", "stop", "ollama"]:
            if "ollama-unloaded" not in m.made:
                self.problems.append("Ollama stopped before its models are unloaded (ollama stop MODEL)")
            m.made.add("ollama-stopped")

    def _launchctl(self, words, m, sudo, heredoc):
        """The domain a service is addressed in must be its plist's: a LaunchDaemon system/, a LaunchAgent gui/."""
        script = (ROOT / "docker" / "install-mac.sh").read_text()
        for w in words[2:]:
            path = re.match(r"/Library/(LaunchDaemons|LaunchAgents)/(.+)\.plist$", w)
            label = path.group(2) if path else w.rsplit("/", 1)[1] if re.match(r"(system|gui)/", w) else None
            if label is None:
                continue
            if not (ROOT / "docker" / "launchd" / f"{label}.plist").is_file():
                self.problems.append(f"{label}: no docker/launchd/{label}.plist")
                continue
            kind = "system" if f"/Library/LaunchDaemons/{label}.plist" in script else "gui"
            domain = words[2] if path else w.split("/", 1)[0]
            if not domain.startswith(kind) or (path and path.group(1) != ("LaunchDaemons" if kind == "system"
                                                                          else "LaunchAgents")):
                self.problems.append(f"{w}: {label} is installed as a {'LaunchDaemon' if kind == 'system' else 'LaunchAgent'}"
                                     f" ({kind}/ domain)")
            if kind == "system" and not sudo:
                self.problems.append("the system domain needs sudo")
            if words[1] == "bootstrap" and label == "com.disagg.decode" and "ollama-stopped" not in m.made:
                self.problems.append("the decode node starts while Ollama still holds its models")

    def _ufw(self, words, m, sudo, heredoc):
        if "enable" in words:
            if not any(22 in ports for _, ports in m.ufw):
                self.problems.append("ufw enabled before SSH is allowed")
            m.made.add("ufw")
        elif words[1] == "allow":
            rule = words[2:]
            if rule[0] in ("OpenSSH", "ssh", "22", "22/tcp"):
                m.ufw.append(("0.0.0.0/0", {22}))
            elif rule[0] == "from":
                m.ufw.append((rule[1], {int(p) for p in rule[rule.index("port") + 1].split(",")}))
            else:
                m.ufw.append(("0.0.0.0/0", {int(rule[0].split("/")[0])}))

    def _docker(self, words, m, sudo, heredoc):
        if words[1] == "build":
            m.made.add("image:" + words[words.index("-t") + 1])
        elif words[1] == "load":
            m.made |= {"image:disagg-prefill", "image:disagg-gateway"}
        elif words[1] == "run":
            self._docker_run(words[2:], m)
        elif words[1] == "compose" and words[2:6] == ["-f", "docker/compose.yaml", "-p", "disagg"] and \
                "up" in words and "--build" not in words and "image:disagg-gateway" not in m.made:
            self.problems.append("compose up without --build before the gateway's image exists")

    def _docker_run(self, args: list[str], m: Machine) -> None:
        entry, i = None, 0
        while args[i].startswith("-"):
            if args[i] == "--entrypoint":
                entry = args[i + 1]
            i += 1 if "=" in args[i] or args[i] in ("-d", "--rm", "-it", "-i", "-t") else 2
        image, rest = args[i], args[i + 1:]
        if "image:" + image not in m.made:
            self.problems.append(f"image {image} is not built or loaded yet on {m.name}")
        if entry == "disagg":
            self.disagg(rest, m)
        elif entry == "hf":
            self._hf(["hf", *rest], m, False, "")
        elif entry is None and image == "disagg-prefill":
            self.disagg(["prefill", *rest], m)  # the image's ENTRYPOINT ["disagg", "prefill"]

    def _bench(self, words: list[str], m: Machine) -> None:
        mod = ROOT / (words[2].replace(".", "/") + ".py")
        if not mod.is_file():
            self.problems.append(f"{words[2]}: no {mod.relative_to(ROOT)}")
            return
        text = mod.read_text()  # its own flags and those of the bench modules it imports (site_target's --config)
        text += "".join((ROOT / "bench" / f"{n}.py").read_text() for n in re.findall(r"from bench\.(\w+) import", text))
        for flag in (w for w in words[3:] if w.startswith("--")):
            if f'"{flag}"' not in text:
                self.problems.append(f"{words[2]} has no {flag}")

    def disagg(self, args: list[str], m: Machine) -> None:
        """The CLI's own parser accepts the line; --node is this machine's; --model a model it serves."""
        import contextlib
        import io

        from backends.cli.main import _parser

        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                ns = _parser().parse_args(args)
        except SystemExit:
            self.problems.append(f"disagg {' '.join(args[:3])}: the CLI refuses it: {err.getvalue().strip()[-200:]}")
            return
        node = getattr(ns, "node", None)
        if node is not None and node != m.name and not (node == "gateway" and m.name == self.gateway_machine):
            self.problems.append(f"--node {node} on {m.name}")
        model, role = getattr(ns, "model", None), getattr(ns, "role", None)
        route = next((r for r in self.settings.models if r.id == model), None)
        if model is not None and route is None:
            self.problems.append(f"--model {model}: not in the seeds' [[models]]")
        elif route is not None and role in ("prefill", "decode") and m.name not in getattr(route, role):
            self.problems.append(f"--model {model} --role {role} on {m.name}: its {role} is {getattr(route, role)}")
        elif route is not None and role == "gateway" and m.name != self.gateway_machine:
            self.problems.append(f"--role gateway on {m.name}: the gateway is on {self.gateway_machine}")
        against = getattr(ns, "against", None) or ""
        spark = re.search(r"(spark-\d+)", against)
        if route is not None and spark and spark.group(1) not in route.prefill:
            self.problems.append(f"--against {against}: {model}'s prefill is {route.prefill}, not {spark.group(1)}")
        given = [getattr(ns, "config", None)] if "--config" in args else []
        for path in given + ([args[2]] if args[:2] == ["config", "check"] else []):
            if path is not None and str(path) not in ("/opt/disagg/config.toml", "examples/site-seeds.toml"):
                self.problems.append(f"--config {path}: the site's config is /opt/disagg/config.toml")

    def finish(self) -> None:
        """What must hold once every block has run: each Spark's 8100 open to the gateway and both Macs."""
        for name, m in self.machines.items():
            if m.kind != "linux" or "ufw" not in m.made:
                continue
            for peer in ("gateway", *[n for n, node in self.nodes.items() if node.role == "decode"]):
                addr = ipaddress.ip_address(self.settings.gateway.reach_host() if peer == "gateway"
                                            else self.nodes[peer].host)
                if not any(8100 in ports and addr in ipaddress.ip_network(src) for src, ports in m.ufw):
                    self.problems.append(f"{name}: ufw lets no 8100 in from {peer} ({addr}): `disagg status` there fails")
