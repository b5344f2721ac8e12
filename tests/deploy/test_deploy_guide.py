"""docs/deploy.md as pasted, block by block on the machine each names: every command checked statically
(tests/support/deploy_guide.py), and what Linux can run run in network namespaces on a bridge standing for the
seeds' switch, each holding its machine's address, as uid 4242 with no passwd entry and no HOME."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.cli import run as disagg
from tests.support.deploy_guide import GUIDE, SEEDS, UPLINK, Block, Walk, blocks, simple_commands, split

TAG = f"dg{os.getpid() % 100000}"
# What runs here, by the command's words (after sudo): the config and secrets, compose's `config`, and these disagg
# subcommands; anything else needs the site (its hardware, its network, a Mac, a daemon) and is only checked.
SHELL_RUNS = re.compile(r"^(sudo install -d |cp examples/|python3 -c |chmod 600 |cat > docker/\.env|mkdir -p /opt/disagg"
                        r"|rm -rf /opt/disagg/downloads/)")
DISAGG_RUNS = (["config", "check"], ["doctor"], ["status"], ["bench", "grading"])


def _walk() -> tuple[list[Block], Walk]:
    bs = blocks(GUIDE.read_text())
    w = Walk()
    for b in bs:
        w.check(b)
    w.finish()
    return bs, w


def test_every_block_names_its_machines_and_passes_the_static_walk():
    """No block is skipped: each is fenced with its machines, and every command in it passes the static walk."""
    bs, w = _walk()
    assert w.checked == len(bs) and len(bs) >= 40
    assert {m for b in bs for m in b.machines} == {*w.nodes, UPLINK}
    assert not w.problems, "\n".join(w.problems)


def test_every_file_the_prose_names_exists():
    """Besides the blocks' (the walk), every repository path the guide's text names in backticks."""
    text = GUIDE.read_text()
    named = set(re.findall(r"`((?:docker|examples|docs|tests|backends|bench|gateway|kv_bridge)/[\w./-]+)", text))
    made = {"docker/.env"}  # section 2 writes it
    assert len(named) > 10 and not {p for p in named - made if not (ROOT / p.rstrip(".")).exists()}


def test_each_mac_prepares_only_its_own_model_and_each_doctor_its_own_node():
    bs, w = _walk()
    for mac in ("mac-studio-1", "mac-studio-2"):
        own = {r.id for r in w.settings.models if mac in r.decode}
        text = "\n".join(c for b in bs if mac in b.machines for c in b.commands if "models prepare" in c)
        assert set(re.findall(r"--model (\S+)", text)) == own, (mac, text)
    for b in bs:
        for c in b.commands:
            for node in re.findall(r"--node (\S+)", c):
                assert node in b.machines or (node == "gateway" and b.machines == (w.gateway_machine,)), (b.line, c)


@pytest.mark.parametrize("machine,text,want", [
    ("mac-studio-1", "sudo launchctl bootout gui/501/com.disagg.decode", "installed as a LaunchDaemon"),
    ("mac-studio-1", "launchctl bootout system/com.disagg.decode", "needs sudo"),
    ("mac-studio-1", "sudo launchctl bootout system/com.disagg.decode && brew services start ollama", "chained"),
    ("mac-studio-1", "sudo launchctl bootstrap system /Library/LaunchDaemons/com.disagg.decode.plist", "Ollama"),
    ("mac-studio-1", "/opt/disagg/.venv/bin/disagg config check /opt/disagg/config.toml", "venv comes later"),
    ("mac-studio-1", "docker/install-mac.sh mac-studio-2", "this Mac's node is mac-studio-1"),
    ("mac-studio-2", "docker/install-mac.sh mac-studio-2\n/opt/disagg/.venv/bin/disagg doctor --node mac-studio-1",
     "--node mac-studio-1 on mac-studio-2"),
    ("mac-studio-1", "docker/install-mac.sh mac-studio-1\n/opt/disagg/.venv/bin/disagg models prepare --model "
     "gpt-oss:120b --role decode --mlx x", "its decode is ['mac-studio-2']"),
    ("mac-studio-2", "docker/install-mac.sh mac-studio-2\n/opt/disagg/.venv/bin/disagg models prepare --model "
     "gpt-oss:120b --role decode --mlx x --against /opt/disagg/downloads/spark-1-files", "not spark-1"),
    ("mac-studio-1", "docker/install-mac.sh mac-studio-1\n/opt/disagg/.venv/bin/disagg doctor --nodes mac-studio-1",
     "the CLI refuses it"),
    ("spark-1", "sudo ufw allow 8000/tcp\nsudo ufw --force enable", "before SSH"),
    ("spark-2", "sudo ufw allow OpenSSH\nsudo ufw allow from 169.254.150.103 to any port 8100 proto tcp\n"
     "sudo ufw --force enable", "no 8100 in from mac-studio-1"),
    ("spark-1", "docker build -f docker/prefill.Dockerfile -t disagg-prefill .", "docker group"),
    ("spark-1", "sudo nmcli con mod \"$CON\" ipv4.method manual", "$CON is not set"),
    ("spark-1", "sudo cp docker/nonexistent.yaml /tmp", "no such file"),
    ("mac-studio-1", "sudo nmcli con up x", "does not exist on mac-studio-1"),
    ("spark-1", "disagg status --config /opt/disagg/config.toml", "no disagg on this machine yet"),
])
def test_the_walk_catches_what_it_looks_for(machine, text, want):
    w = Walk()
    w.check(Block(1, "sh", (machine,), text, split(text.splitlines())))
    w.finish()
    assert any(want in p for p in w.problems), w.problems


def test_commands_split_as_pasted():
    cmds = split(["a \\", "--b c   # note", "# only a comment", "cat > x <<'EOF'", "K=$1 # kept", "EOF", "d"])
    assert cmds == ["a --b c", "cat > x <<'EOF'\nK=$1 # kept\nEOF", "d"]
    words = [w for w, _ in simple_commands('X="$(python3 -c \'print(f(1))\')"; sync; echo 3 | sudo tee /p >/dev/null')]
    assert words == [["python3", "-c", "print(f(1))"], ["X=SUBST"], ["sync"], ["echo", "3"], ["sudo", "tee", "/p"]]


# ---- what runs here: the seeds' switch in network namespaces ----

def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _why_not() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        return "needs Linux, root, iproute2 and unshare(1)"
    r = subprocess.run(["ip", "netns", "add", f"{TAG}probe"], capture_output=True, text=True)
    if r.returncode:
        return f"ip netns add fails here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"{TAG}probe"], capture_output=True)
    return None


@pytest.fixture(scope="module")
def switch():
    """A bridge (the switch) in its own namespace and one namespace per seed machine on it, with its address/16."""
    why = _why_not()
    if why:
        pytest.skip(why)
    w = Walk()
    spaces, made = {}, []
    try:
        _ip("netns", "add", f"{TAG}sw")
        made.append(f"{TAG}sw")
        _ip("-n", f"{TAG}sw", "link", "add", "br0", "type", "bridge")
        _ip("-n", f"{TAG}sw", "link", "set", "br0", "up")
        for i, (name, node) in enumerate(w.nodes.items()):
            ns = f"{TAG}m{i}"
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "add", "en0", "type", "veth", "peer", "name", f"p{i}", "netns", f"{TAG}sw")
            _ip("-n", f"{TAG}sw", "link", "set", f"p{i}", "master", "br0")
            _ip("-n", f"{TAG}sw", "link", "set", f"p{i}", "up")
            _ip("-n", ns, "addr", "add", f"{node.host}/16", "dev", "en0")
            _ip("-n", ns, "link", "set", "en0", "up")
            spaces[name] = ns
        yield spaces
    finally:
        for ns in made:  # a namespace's veth ends go with it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _disagg_args(words: list[str]) -> list[str] | None:
    """The disagg arguments of a line that runs disagg (directly, through the venv, the wrapper or an image)."""
    if re.fullmatch(r"(\S*/)?disagg", words[0]):
        return words[1:]
    if words[:2] == ["docker", "run"] and "--entrypoint" in words and words[words.index("--entrypoint") + 1] == "disagg":
        return words[words.index("--entrypoint") + 3:]
    return None


def _as_site_user(ns: str, args: list[str], opt: Path, repo: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_") and k not in ("HOME", "TMPDIR")}
    env["PYTHONPATH"] = str(ROOT)
    cmd = ["ip", "netns", "exec", ns, "unshare", "-U", "--map-user=4242", "--map-group=4242", "env", "-u", "HOME",
           "-u", "TMPDIR", sys.executable, "-m", "backends.cli.main", *[a.replace("/opt/disagg", str(opt)) for a in args]]
    return subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300)


HARDWARE = {"prefill": ("gpu", "memory", "model "), "decode": ("mlx", "memory", "model "), "gateway": ("model ", "reach ")}


def _assert_ran(machine: str, args: list[str], r: subprocess.CompletedProcess, w: Walk) -> None:
    out = r.stdout + r.stderr
    assert "Traceback" not in out, (machine, args, out)
    if args[:2] == ["config", "check"]:
        assert r.returncode == 0 and "config OK" in r.stdout, out
        assert "docker/compose.yaml not here" not in out and "sudo ufw allow 11434/tcp" in r.stdout, out
    elif args[0] == "doctor":
        node = args[args.index("--node") + 1]
        role = "gateway" if node == "gateway" else w.nodes[node].role
        lines = r.stdout.splitlines()
        assert lines[-1].startswith(f"{node}: "), out
        assert "owned by uid 4242, mode 0600" in r.stdout and "ok    link-local: only en0 holds" in r.stdout, out
        fails = [ln for ln in lines if ln.startswith("FAIL") and not ln[6:].startswith(HARDWARE[role])]
        assert not fails, (machine, fails)  # what fails here is the hardware's (no GPU, Metal, model folders)
        assert all(ln.startswith("ok") for ln in lines if re.match(r"\S+\s+route to ", ln)), out
    elif args[0] == "status":
        assert r.returncode == 1 and "DOWN" in r.stdout, out  # nothing serves in the namespaces
    else:
        assert r.returncode == 0 and "highest concurrency" in r.stdout, out


def test_the_guide_runs_in_order_in_the_seeds_network(switch, tmp_path):
    """Each block in order: the commands that can run here run (on a machine's namespace for disagg), the rest were
    checked by the static walk; prints how many of each."""
    opt, repo = tmp_path / "opt", tmp_path / "repo"
    opt.mkdir()
    repo.mkdir()
    for d in ("docker", "examples"):
        shutil.copytree(ROOT / d, repo / d)
    bs, w = _walk()
    ran, static, jobs, cache = set(), 0, [], {}
    pool = ThreadPoolExecutor(2)  # a prefill doctor imports vLLM (~10 s): two at a time on this 2-core box
    for b in bs:
        for machine in b.machines:
            for cmd in b.commands:
                words = simple_commands(cmd)[-1][0] if simple_commands(cmd) else []
                args = _disagg_args(words[1:] if words[:1] == ["sudo"] else words) if words else None
                if machine != UPLINK and args and any(args[:len(k)] == k for k in DISAGG_RUNS):
                    key = (machine, tuple(args))  # the same line again on the same machine: the same files
                    if key not in cache:
                        cache[key] = pool.submit(_as_site_user, switch[machine], args, opt, repo)
                        jobs.append((machine, args, cache[key]))
                    ran.add(b.line)
                elif machine != UPLINK and SHELL_RUNS.match(cmd):
                    local = re.sub(r"^sudo ", "", cmd).replace("/opt/disagg", str(opt))  # root here, as sudo is
                    r = subprocess.run(["ip", "netns", "exec", switch[machine], "bash", "-euc", local], cwd=repo,
                                       capture_output=True, text=True, timeout=60)
                    assert r.returncode == 0, (cmd, r.stderr)
                    ran.add(b.line)
                elif cmd.startswith("docker compose -f docker/compose.yaml -p disagg "):
                    _compose(repo)
                    ran.add(b.line)
                else:
                    static += 1
    for machine, args, job in jobs:
        _assert_ran(machine, args, job.result(), w)
    pool.shutdown()
    print(f"\n{len(bs)} blocks: {len(ran)} run here (in part or whole; {len(jobs)} disagg runs in the seeds' "
          f"namespaces), {len(bs) - len(ran)} checked statically only; {static} commands checked, not run")
    assert (opt / "node-secret").stat().st_mode & 0o777 == 0o600 and (repo / "docker/.env").stat().st_mode & 0o777 == 0o600
    assert {a[0] for _, a, _ in jobs} >= {"config", "doctor", "status", "bench"}
    assert {m for m, a, _ in jobs if a[0] == "doctor"} == set(w.nodes)  # every machine's own doctor line ran


def test_a_thunderbolt_bridge_address_fails_the_macs_doctor(switch, tmp_path):
    """Section 1: a second interface on 169.254/16 (a Mac's Thunderbolt Bridge, self-assigned) fails doctor's
    link-local line, naming the fix; the guide's doctor line, as pasted, on mac-studio-1's namespace."""
    opt = tmp_path / "opt"
    opt.mkdir()
    (opt / "config.toml").write_text(SEEDS.read_text())
    (opt / "node-secret").write_text("guide-test-secret-0123456789abcdef\n")
    (opt / "node-secret").chmod(0o600)
    line = next(c for b in blocks(GUIDE.read_text()) if b.machines == ("mac-studio-1",) for c in b.commands
                if "doctor" in c)
    ns = switch["mac-studio-1"]
    _ip("-n", ns, "link", "add", "bridge0", "type", "veth", "peer", "name", "tb1")
    try:
        _ip("-n", ns, "addr", "add", "169.254.77.5/16", "dev", "bridge0")
        _ip("-n", ns, "link", "set", "bridge0", "up")
        _ip("-n", ns, "link", "set", "tb1", "up")
        r = _as_site_user(ns, _disagg_args(line.split()), opt, tmp_path)
    finally:
        _ip("-n", ns, "link", "del", "bridge0")
    assert "Traceback" not in r.stderr and r.returncode == 1, r.stdout + r.stderr
    assert re.search(r"FAIL  link-local: 2 interfaces hold 169.254.0.0/16 addresses .*bridge0", r.stdout), r.stdout
    assert "Thunderbolt Bridge" in r.stdout


def _compose(repo: Path) -> None:
    """`docker compose -f docker/compose.yaml -p disagg ...`: `config`, with the `.env` the guide wrote by then."""
    assert (repo / "docker/.env").is_file(), "docker/.env is not written yet"
    r = subprocess.run([shutil.which("docker-compose"), "-f", "docker/compose.yaml", "-p", "disagg", "config"],
                       cwd=repo, capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and "GF_SECURITY_ADMIN_PASSWORD" in r.stdout, r.stderr


TINY = ROOT / ".disagg" / "site" / "models" / "gpt-oss-tiny"  # `make site-models`: gpt_oss, MXFP4 experts as published


@pytest.mark.skipif(not (TINY / "config.json").is_file(), reason="needs `make site-models` (the tiny gpt_oss)")
def test_gpt_oss_mac_commands_run_as_written(tmp_path):
    """Section 5's mac-studio-2 block, as pasted, on a tiny checkpoint in the official format (MXFP4 experts,
    quant_method mxfp4) standing for openai/gpt-oss-120b and a temporary folder for /opt/disagg: mlx-lm's converter
    with the guide's flags, then `models prepare --mlx ... --against` spark-2's files (the prefill side's folder's
    json, as the guide's scp fetches them), and a wrong fingerprint refused."""
    from kv_bridge.fingerprint import model_fingerprint

    cmds = [c for b in blocks(GUIDE.read_text()) if b.machines == ("mac-studio-2",) for c in b.commands]
    convert = next(c for c in cmds if "mlx_lm.convert" in c)
    prepare = next(c for c in cmds if "--model gpt-oss:120b" in c and "--mlx" in c)
    opt = tmp_path / "opt"
    (opt / "downloads" / "spark-2-files").mkdir(parents=True)
    (opt / "downloads" / "gpt-oss-120b-hf").symlink_to(TINY, target_is_directory=True)
    spark2 = TINY.with_name("gpt-oss-tiny-vllm")
    for f in spark2.glob("*.json"):
        shutil.copyfile(f, opt / "downloads" / "spark-2-files" / f.name)
    (opt / "config.toml").write_text(SEEDS.read_text().replace("/opt/disagg", str(opt)))
    local = convert.replace("/opt/disagg/.venv/bin/", f"{Path(sys.executable).parent}/").replace("/opt/disagg", str(opt))
    r = subprocess.run(["bash", "-euc", local], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (local, r.stdout, r.stderr)
    assert '"mode": "mxfp4"' in (opt / "downloads" / "gpt-oss-120b-mlx" / "config.json").read_text()
    for against, ok in (("0" * 16, False), (None, True)):
        text = prepare if against is None else re.sub(r"--against \S+", f"--against {against}", prepare)
        r = disagg(*text.replace("/opt/disagg", str(opt)).split()[1:], cwd=tmp_path)
        assert "Traceback" not in r.stderr, r.stderr
        if ok:
            assert r.returncode == 0 and "fingerprints agree" in r.stdout, r.stdout + r.stderr
            assert "mlx" in r.stdout and "mxfp4" in r.stdout.lower() and model_fingerprint(str(spark2)) in r.stdout
        else:
            assert r.returncode == 1 and "fingerprints differ" in r.stderr, r.stdout + r.stderr
