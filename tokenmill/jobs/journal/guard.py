"""What keeps a command's writes where they belong: never on one of its inputs, and never into
an output another run is writing.

A command names what it writes or deletes as a `Footprint` (files, and folders it owns whole)
and calls `refuse_inputs_in` before it deletes anything: `--overwrite` may discard an earlier
*output*, never an input. `OutputLock` makes one writer per output: an advisory lock (flock) on a
file beside the results, held for the command's life. The kernel releases it when the process
ends, however it ends, so a killed run leaves nothing to clean up; the lock file itself stays
(deleting it would let a run waiting on the old file and a new run on a new file both hold "the"
lock). A lock is local to one machine (and to a shared file system that honours flock).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from tokenmill.jobs import storage
from tokenmill.jobs.errors import JobError
from tokenmill.jobs.storage import Location


@dataclass(frozen=True)
class Footprint:
    """What a command writes or deletes: single files, and folders whose every file is its own."""

    files: tuple[Location, ...] = ()
    folders: tuple[Location, ...] = ()

    def holding(self, path: Location) -> tuple[Location, bool] | None:
        """The file (False) or folder (True) of this footprint that `path` is or lies in."""
        for written in self.files:
            if _same_file(path, written):
                return written, False
        for folder in self.folders:
            if _inside(path, folder):
                return folder, True
        return None

    def __add__(self, other: Footprint) -> Footprint:
        return Footprint(self.files + other.files, self.folders + other.folders)


def with_temporaries(paths: Iterable[Path]) -> tuple[Path, ...]:
    """The files and the `.tmp` beside each that an atomic rewrite of it replaces."""
    return tuple(p for path in paths for p in (path, path.with_name(path.name + ".tmp")))


def refuse_inputs_in(footprint: Footprint, inputs: Mapping[str, Location | None]) -> None:
    """JobError, before anything is written, when one of `inputs` (named by their role: "the
    input", "--expected") is a file the command writes or deletes."""
    for role, path in inputs.items():
        if path is None or (found := footprint.holding(path)) is None:
            continue
        written, is_folder = found
        where = f"lies in {written}, a folder" if is_folder else f"is {written}, a file"
        raise JobError(f"{role} {path} {where} this command writes (and --overwrite deletes): it would destroy its "
                       "own input. Write the output somewhere else (another -o or --errors), or move the input out")


def _same_file(a: Location, b: Location) -> bool:
    if storage.is_url(a) or storage.is_url(b):
        return storage.is_url(a) and storage.is_url(b) and _url_key(a) == _url_key(b)
    try:
        return os.path.samefile(a, b)  # also a symlink or hard link to it
    except OSError:  # one of them does not exist, so they are not one file
        return False


def _inside(path: Location, folder: Location) -> bool:
    if storage.is_url(path) or storage.is_url(folder):
        return storage.is_url(path) and storage.is_url(folder) and _url_key(path).startswith(_url_key(folder) + "/")
    return Path(path).resolve().is_relative_to(Path(folder).resolve())


def _url_key(url: Location) -> str:
    return str(url).rstrip("/")


class OutputLock:
    """Held while a command writes `output`; a second command on the same output is refused with
    the holder's pid and command line, and `advice` (what to change instead).

    `path` is a lock file the holder writes its name into, or a folder the command owns whole
    (split's parts: nothing but parts may lie there), locked itself, whose holder is looked up in
    the kernel's lock table."""

    def __init__(self, path: Path, output: Location, advice: str = "choose another -o") -> None:
        self.path, self.output, self.advice = path, output, advice
        self._fd = -1

    def __enter__(self) -> OutputLock:
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise JobError(f"{self.output} is being written by another tokenmill ({holder}; lock {self.path}): "
                           f"two writers would mix their rows. Wait for it to finish or stop it, or "
                           f"{self.advice}") from None
        if not self.path.is_dir():
            os.ftruncate(fd, 0)
            os.write(fd, (json.dumps(_me()) + "\n").encode())
        self._fd = fd
        return self

    def _open(self) -> int:
        if self.path.is_dir():
            return os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = -1


def _me() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(sys.argv)}


def _holder(fd: int) -> str:
    """Who holds the lock: as the holder wrote it (it writes just after locking, so it may not yet
    have), or for a folder, the pid the kernel's lock table gives."""
    try:
        me = json.loads(os.pread(fd, 4096, 0))
        return f"pid {me['pid']} on {me['host']} since {me['since']}: {me['command']}"
    except IsADirectoryError:
        pid = _flock_holder(os.fstat(fd))
        return f"pid {pid}" if pid else "its pid is unknown"
    except (OSError, ValueError, KeyError, TypeError):
        return "its pid is not recorded yet"


def _flock_holder(stat: os.stat_result) -> int | None:
    """The pid /proc/locks gives for a flock on the file `stat` describes (Linux only)."""
    inode = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    try:
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    for entry in table.splitlines():
        fields = entry.split()  # "1: FLOCK  ADVISORY  WRITE 4711 08:01:1234 0 EOF"
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode:
            return int(fields[4])
    return None
