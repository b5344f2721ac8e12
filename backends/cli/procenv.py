"""What a `disagg` command needs of its process, made to hold where the images run it (`docker run -u UID:GID`, a
read-only root): a user with no passwd entry, no HOME (or docker's HOME=/, unwritable), no writable /tmp."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# Where a temporary folder may live besides Python's own list (TMPDIR, /tmp, /var/tmp, /usr/tmp, cwd): docker keeps
# /dev/shm a writable tmpfs under --read-only.
EXTRA_TMP = ("/dev/shm",)


def user_name(uid: int | None = None) -> str:
    """The passwd name of `uid` (default: this process's), or "uid N" when the image has no entry for it."""
    import pwd

    uid = os.geteuid() if uid is None else uid
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def writable(path: str | Path) -> bool:
    """A folder this process can create files in (tried: access() lies on a read-only mount for root)."""
    try:
        fd, name = tempfile.mkstemp(prefix=".disagg-probe-", dir=path)
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


def _tmp_candidates(extra: tuple) -> list[str]:
    env = [os.environ[k] for k in ("TMPDIR", "TEMP", "TMP") if os.environ.get(k)]
    return env + ["/tmp", "/var/tmp", "/usr/tmp", *EXTRA_TMP, *map(str, extra)]


def ensure(extra_tmp: tuple = ()) -> list[str]:
    """Give this process a usable temporary folder and HOME before torch, vLLM, mlx-lm or transformers import (dill
    reads tempfile.gettempdir() at import; torch, Triton and HF cache under ~). Returns what it set, one line each;
    raises OSError with the fix when no folder at all is writable."""
    notes = []
    tmp = next((d for d in _tmp_candidates(extra_tmp) if os.path.isdir(d) and writable(d)), None)
    if tmp is None:
        raise OSError("no writable temporary folder (tried " + ", ".join(_tmp_candidates(extra_tmp)) +
                      "): run the container with --tmpfs /tmp, or set TMPDIR to a writable folder")
    if tmp != os.environ.get("TMPDIR") and tmp not in ("/tmp", "/var/tmp", "/usr/tmp"):
        os.environ["TMPDIR"] = tmp
        tempfile.tempdir = None  # recomputed from TMPDIR on next use
        notes.append(f"TMPDIR={tmp} (/tmp is not writable)")
    home = os.environ.get("HOME")
    if not home or not os.path.isdir(home) or not writable(home):
        new = Path(tmp) / f"disagg-home-{os.geteuid()}"
        new.mkdir(mode=0o700, exist_ok=True)
        os.environ["HOME"] = str(new)
        notes.append(f"HOME={new} ({'unset' if not home else home + ' is not writable'}; caches go there: mount a "
                     f"volume and set HOME to keep them)")
    for n in notes:
        log.info("process: %s", n)
    return notes
