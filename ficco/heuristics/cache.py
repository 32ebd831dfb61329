"""The files ficco keeps for itself: measured winners (``auto``, ``tune``) and calibrated
profiles, under :func:`~ficco.heuristics.profiles.cache_root`.

What the cache promises (docs/design.md):

- **Optional.** It only saves measuring again. A directory that cannot be made or written
  (a read-only HOME, a full disk), an entry that is corrupt, not UTF-8, a directory, or
  unreadable: each is warned about once per file and otherwise ignored; no call fails for it.
- **Bounded, flat reads, safe writers.** One small file per key (``<dir>/<sha1 of key>.json``),
  written to a temporary file and renamed into place, so any number of processes of any jobs
  on one host may write at once and a reader sees a whole entry or none; a lookup reads one
  file whatever the cache holds. At most :data:`MAX_ENTRIES` per directory (plus the few a
  process wrote since it last trimmed it: at its first write there, then every
  ``MAX_ENTRIES // 64`` writes): a trim drops the least recently used (by modification time;
  a read hit refreshes it).
- **Per user.** The default root is the user's (``$XDG_CACHE_HOME/ficco``, ``~/.cache/ficco``);
  directories are made ``0700`` and files ``0600``. A file or directory that another user
  owns, or that others may write, is refused (warned, never read): a shared
  ``FICCO_CACHE_DIR`` cannot hand one user another's decisions.
- **Expiring.** Every entry records the ficco and torch versions it was measured under
  (measured keys also name the device); an entry from another version is stale: ignored and
  removed.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import threading
import warnings
from pathlib import Path

#: entries kept per cache directory (a serving process meets new keys all day)
MAX_ENTRIES = 2048
#: what a write trims a full directory down to (a fraction of MAX_ENTRIES: trimming is rare)
TRIM_TO = 0.75
FORMAT = 1



def stamp() -> dict:
    """What an entry is measured under: the file format, the ficco and torch versions."""
    import torch

    module = sys.modules.get("ficco")
    return {"format": FORMAT, "ficco": str(getattr(module, "__version__", "unknown")),
            "torch": torch.__version__}


def warn_once(path: Path | str, what: str, instead: str = "ficco measures again instead"
              ) -> None:
    """One FiccoWarning per file and kind of fault, naming the file and what was done."""
    from ..errors import FiccoWarning, first_time

    if not first_time(("cache", str(path), what.split(":")[0])):
        return
    warnings.warn(f"ficco cache {str(path)!r}: {what}; {instead} (the cache is optional; "
                  f"FICCO_CACHE_DIR moves it)", stacklevel=4, category=FiccoWarning)


def trusted(path: Path, st: os.stat_result | None = None) -> str | None:
    """Why ``path`` must not be trusted (None: it may be): it belongs to another user, or
    others may write it."""
    if not hasattr(os, "getuid"):   # (no owners to compare on this platform)
        return None
    try:
        st = st or os.stat(path)
    except OSError:
        return None
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not this user ({os.getuid()}): not read"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by others (mode {stat.filemode(st.st_mode)}): not read"
    return None


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path``, or None: missing (silently), or refused, corrupt,
    unreadable, not an object (warned once)."""
    try:
        # (non-blocking: a FIFO in an entry's place must not stall the call)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        warn_once(path, f"cannot be read ({exc.strerror or exc})")
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            warn_once(path, "is not a regular file")
            return None
        why = trusted(path, st)
        if why:
            warn_once(path, why)
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read()
    except OSError as exc:
        warn_once(path, f"cannot be read ({exc.strerror or exc})")
        return None
    finally:
        os.close(fd)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        warn_once(path, "is corrupt (not UTF-8 JSON)")
        return None
    if not isinstance(data, dict):
        warn_once(path, "is corrupt (not a JSON object)")
        return None
    return data


def _usable_dir(directory: Path) -> bool:
    """Make ``directory`` (0700) if missing; whether entries may be written there."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        warn_once(directory, f"cannot be made ({exc.strerror or exc}); nothing is kept")
        return False
    if not directory.is_dir():
        warn_once(directory, "is not a directory; nothing is kept")
        return False
    why = trusted(directory)
    if why:
        warn_once(directory, why.replace("not read", "nothing is kept there"))
        return False
    return True


class EntryFiles:
    """Entries by key, one file each, in ``directory()`` (a callable: the root is a setting,
    read when used)."""

    def __init__(self, name: str, root):
        self.name, self._root = name, root
        self._writes: dict[str, int] = {}     # writes since the last trim, per directory

    def directory(self) -> Path:
        return Path(self._root()) / self.name

    def file_of(self, key: str) -> Path:
        return self.directory() / f"{hashlib.sha1(key.encode()).hexdigest()[:32]}.json"

    def get(self, key: str) -> dict | None:
        """The entry for ``key``, or None (missing, refused, corrupt or stale: warned)."""
        path = self.file_of(key)
        data = read_json(path)
        if data is None:
            return None
        if data.get("key") != key or not isinstance(data.get("entry"), dict):
            warn_once(path, "is corrupt (not an entry of this key)")
            return None
        if data.get("made_by") != stamp():
            _remove(path)     # measured under another ficco or torch: stale
            return None
        try:
            os.utime(path)    # recently used: kept longest
        except OSError:
            pass
        return data["entry"]

    def put(self, key: str, entry: dict) -> bool:
        """Write ``entry`` for ``key`` (atomic; warned and skipped when it cannot be)."""
        directory = self.directory()
        if not _usable_dir(directory):
            return False
        path = self.file_of(key)
        tmp = directory / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        text = json.dumps({"key": key, "entry": entry, "made_by": stamp()}, sort_keys=True)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text + "\n")
            os.replace(tmp, path)
        except OSError as exc:
            _remove(tmp)
            warn_once(directory, f"cannot be written ({exc.strerror or exc}); the decision is "
                                 f"kept in memory only")
            return False
        # A trim lists the directory: once per MAX_ENTRIES // 64 writes of this process, so a
        # write stays cheap while the directory overshoots by a few entries at most.
        # (the first write of this process into a directory trims it)
        writes = self._writes.get(str(directory), MAX_ENTRIES) + 1
        if writes >= max(1, MAX_ENTRIES // 64):
            writes = 0
            self.trim()
        if len(self._writes) > 64:
            self._writes.clear()
        self._writes[str(directory)] = writes
        return True

    def trim(self, most: int | None = None) -> None:
        """Keep at most ``most`` entries (:data:`MAX_ENTRIES`): beyond, drop the least
        recently used down to ``TRIM_TO`` of it."""
        most = MAX_ENTRIES if most is None else most
        try:
            with os.scandir(self.directory()) as it:
                files = [(e.stat().st_mtime_ns, e.path) for e in it
                         if e.name.endswith(".json") and e.is_file(follow_symlinks=False)]
        except OSError:
            return
        if len(files) <= most:
            return
        files.sort()
        for _, path in files[:len(files) - int(most * TRIM_TO)]:
            _remove(Path(path))

    def keys(self) -> dict:
        """Every readable entry, by key (tests, tools)."""
        return entries_in(self.directory())

    def clear(self) -> None:
        """Remove every entry file (tests: a new machine)."""
        try:
            paths = list(self.directory().glob("*.json"))
        except OSError:
            return
        for path in paths:
            _remove(path)


def entries_in(directory: Path) -> dict:
    """Every readable entry of the cache directory ``directory``, by key.

    >>> entries_in(Path("/no/such/directory"))
    {}
    """
    out: dict[str, object] = {}
    try:
        names = sorted(Path(directory).glob("*.json"))
    except OSError:
        return out
    for path in names:
        data = read_json(path)
        if data is not None and isinstance(data.get("key"), str):
            out[data["key"]] = data.get("entry")
    return out


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
