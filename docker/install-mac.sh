#!/bin/bash
# Install a disagg decode node on a Mac (Apple Silicon, macOS 14+): /opt/disagg owned by you, a Python 3.11+ venv
# with the `decode` extra, and the launchd agent com.disagg.decode running `disagg decode --node NODE`.
# Run it as the user who stays logged in (not with sudo; it asks for sudo only to create /opt/disagg):
#   docker/install-mac.sh mac-0        (from the repository root; docs/deploy.md step 4)
set -euo pipefail

NODE="${1:-}"
PREFIX=/opt/disagg
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PLIST_SRC="$REPO/docker/launchd/com.disagg.decode.plist"
AGENT="$HOME/Library/LaunchAgents/com.disagg.decode.plist"

die() { echo "install-mac: $*" >&2; exit 1; }

[ -n "$NODE" ] || die "usage: $0 NODE_NAME   (the decode node's [[nodes]] name, e.g. mac-0)"
[ "$(id -u)" -ne 0 ] || die "run as the logged-in user, not root: the service is that user's LaunchAgent (Metal)"
[ "$(uname -s)" = Darwin ] || die "this is for macOS; Linux machines run the Docker images"
[ "$(uname -m)" = arm64 ] || die "MLX needs Apple Silicon (arm64); this Mac is $(uname -m)"
major="$(sw_vers -productVersion | cut -d. -f1)"
[ "$major" -ge 14 ] || die "MLX wheels need macOS 14 or later; this is $(sw_vers -productVersion)"

# macOS's own python3 is 3.9; the project needs 3.11+ (Homebrew: brew install python@3.12)
PY=""
for cand in python3.13 python3.12 python3.11 /opt/homebrew/bin/python3.13 /opt/homebrew/bin/python3.12 \
            /opt/homebrew/bin/python3.11; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        PY="$(command -v "$cand")"
        break
    fi
done
[ -n "$PY" ] || die "no Python 3.11+ found: brew install python@3.12 (macOS's python3 is 3.9), then run this again"
echo "python: $PY ($("$PY" --version))"

# /opt/disagg and its logs folder, owned by this user: launchd exits 78 when the log path cannot be opened
sudo install -d -o "$(id -un)" -g staff -m 755 "$PREFIX" "$PREFIX/logs" "$PREFIX/models"

"$PY" -m venv "$PREFIX/.venv"
"$PREFIX/.venv/bin/pip" install --upgrade pip
"$PREFIX/.venv/bin/pip" install "${REPO}[decode]"

mkdir -p "$HOME/Library/LaunchAgents"
sed "s/NODE_NAME/$NODE/" "$PLIST_SRC" > "$AGENT"
plutil -lint "$AGENT" >/dev/null

mem_gib=$(( $(sysctl -n hw.memsize) / 1073741824 ))
cat <<EOF

Installed into $PREFIX (venv, logs) and $AGENT.
Before the service can start (it is not started yet):
  - $PREFIX/config.toml (examples/site.toml, edited) and $PREFIX/node-secret (chmod 600, owned by $(id -un));
  - the models: $PREFIX/.venv/bin/disagg models prepare --config $PREFIX/config.toml --model ID --role decode ...
  - check: $PREFIX/.venv/bin/disagg config check $PREFIX/config.toml
Metal may wire only about 75% of the ${mem_gib} GiB by default; let it have all but the 8 GiB config check reserves
(resets at reboot: run it again after one, or from a LaunchDaemon):
  sudo sysctl iogpu.wired_limit_mb=$(( (mem_gib - 8) * 1024 ))
Keep the Mac awake and logged in: sudo pmset -a sleep 0 disksleep 0 (and System Settings > Lock Screen: never).
FileVault: after a reboot the Mac waits at the unlock screen with no user session, so no LaunchAgent runs; use
'sudo fdesetup authrestart' for planned reboots, or turn FileVault off and enable automatic login.
EOF

# Not started here: the node loads every model at start, so the models come first (and converting one needs the
# memory the running node would hold). An agent already loaded is restarted on the new venv.
if launchctl print "gui/$(id -u)/com.disagg.decode" >/dev/null 2>&1; then
    launchctl kickstart -k "gui/$(id -u)/com.disagg.decode"
    echo "restarted com.disagg.decode for node $NODE; log: $PREFIX/logs/decode.log"
else
    echo "Then start it:  launchctl bootstrap gui/$(id -u) $AGENT   (log: $PREFIX/logs/decode.log)"
fi
