#!/bin/bash
# Install a disagg decode node on a Mac (Apple Silicon, macOS 14+): /opt/disagg owned by you, a Python 3.11+ venv
# with the `decode` extra, the LaunchDaemon com.disagg.decode running `disagg decode --node NODE` as you (no login
# session needed: it starts at boot and survives a logout), the LaunchDaemon that sets Metal's wired limit at every
# boot, and decode.log's rotation (newsyslog).
# RESERVED_GIB=12 docker/install-mac.sh mac-studio-1: keep more than 8 GiB for macOS (match [[nodes]] reserved_gib).
# Run it as the user the node runs as (not with sudo; it asks for sudo for /opt/disagg and /Library/LaunchDaemons):
#   docker/install-mac.sh mac-studio-1   (this Mac's [[nodes]] name; from the repository root; docs/deploy.md section 4)
# Offline: PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR docker/install-mac.sh NODE installs from a wheelhouse (pip reads both).
set -euo pipefail

NODE="${1:-}"
PREFIX=/opt/disagg
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PLIST_SRC="$REPO/docker/launchd/com.disagg.decode.plist"
SERVICE=/Library/LaunchDaemons/com.disagg.decode.plist
OLD_AGENT="$HOME/Library/LaunchAgents/com.disagg.decode.plist"  # before: a LaunchAgent, stopped by a logout
LIMIT_SRC="$REPO/docker/launchd/com.disagg.wired-limit.plist"
DAEMON=/Library/LaunchDaemons/com.disagg.wired-limit.plist
ROTATE_SRC="$REPO/docker/launchd/com.disagg.decode.newsyslog.conf"
ROTATE=/etc/newsyslog.d/com.disagg.decode.conf
# what macOS keeps beside Metal: config check's reserved_gib for a decode node (8 unless [[nodes]] says otherwise)
RESERVED_GIB="${RESERVED_GIB:-8}"

die() { echo "install-mac: $*" >&2; exit 1; }

[ -n "$NODE" ] || die "usage: $0 NODE_NAME   (the decode node's [[nodes]] name, e.g. mac-studio-1)"
[ "$(id -u)" -ne 0 ] || die "run as the user the node runs as, not root: it owns /opt/disagg and its secret"
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

# The decode service: a LaunchDaemon (system domain, root-owned plist) that runs as this user (UserName): it starts
# at boot and keeps running with nobody logged in; a LaunchAgent would stop at logout.
tmp="$(mktemp)"
sed -e "s/NODE_NAME/$NODE/" -e "s/USER_NAME/$(id -un)/" -e "s#USER_HOME#$HOME#" "$PLIST_SRC" > "$tmp"
plutil -lint "$tmp" >/dev/null
if [ -f "$OLD_AGENT" ]; then  # an install from before: stop and remove the agent, or both would bind the port
    launchctl bootout "gui/$(id -u)/com.disagg.decode" 2>/dev/null || true
    rm -f "$OLD_AGENT"
    echo "removed the old LaunchAgent $OLD_AGENT"
fi
loaded=0
if sudo launchctl print system/com.disagg.decode >/dev/null 2>&1; then
    loaded=1
fi
sudo install -o root -g wheel -m 644 "$tmp" "$SERVICE"
rm -f "$tmp"

# Metal's GPU wired limit, persistent: iogpu.wired_limit_mb resets to 0 (about 75% of RAM) at every boot, below the
# models and KV; a LaunchDaemon sets it before anyone logs in. The decode node checks it at start and refuses to run
# without room (backends/decode/mac_memory.py); `disagg doctor` reports it.
mem_gib=$(( $(sysctl -n hw.memsize) / 1073741824 ))
limit_mb=$(( (mem_gib - RESERVED_GIB) * 1024 ))
tmp="$(mktemp)"
sed "s/WIRED_LIMIT_MB/$limit_mb/" "$LIMIT_SRC" > "$tmp"
plutil -lint "$tmp" >/dev/null
sudo install -o root -g wheel -m 644 "$tmp" "$DAEMON"
rm -f "$tmp"
sudo launchctl bootout system/com.disagg.wired-limit 2>/dev/null || true
sudo launchctl bootstrap system "$DAEMON"
sudo sysctl "iogpu.wired_limit_mb=$limit_mb" >/dev/null
[ "$(sysctl -n iogpu.wired_limit_mb)" = "$limit_mb" ] || die "iogpu.wired_limit_mb did not take $limit_mb"
echo "wired limit: iogpu.wired_limit_mb=$limit_mb (${mem_gib} GiB less ${RESERVED_GIB}), set at every boot by $DAEMON"

# decode.log rotation (newsyslog: 50 MB, 7 kept); the node reopens its log when it is renamed
sed "s/USER:/$(id -un):/" "$ROTATE_SRC" | sudo tee "$ROTATE" >/dev/null
sudo chmod 644 "$ROTATE"

cat <<EOF

Installed into $PREFIX (venv, logs) and $SERVICE (runs as $(id -un), no login needed).
Before the service can start (it is not started yet):
  - $PREFIX/config.toml (examples/site-seeds.toml) and $PREFIX/node-secret (chmod 600, owned by $(id -un));
  - this Mac's model only: $PREFIX/.venv/bin/disagg models prepare --config $PREFIX/config.toml --model ID --role decode ...
  - check: $PREFIX/.venv/bin/disagg config check $PREFIX/config.toml
  - check this Mac: $PREFIX/.venv/bin/disagg doctor --config $PREFIX/config.toml --node $NODE
Keep the Mac awake and booting after a power loss (no one needs to stay logged in):
  sudo pmset -a sleep 0 disksleep 0 autorestart 1
FileVault: after a reboot the Mac waits at the pre-boot unlock screen and nothing starts, daemons included; use
'sudo fdesetup authrestart' for planned reboots, or turn FileVault off for unattended power-loss recovery.
EOF

# Not started here: the node loads every model at start, so the models come first (and converting one needs the
# memory the running node would hold). A service already loaded is reloaded with the new plist and venv.
if [ "$loaded" = 1 ]; then
    sudo launchctl bootout system/com.disagg.decode 2>/dev/null || true
    sudo launchctl bootstrap system "$SERVICE"
    echo "restarted com.disagg.decode for node $NODE; log: $PREFIX/logs/decode.log (crashes: decode.out)"
else
    echo "Then start it:  sudo launchctl bootstrap system $SERVICE   (log: $PREFIX/logs/decode.log)"
fi
