"""Where a job's files live: a local path, or a URL (`s3://`, `gs://`, `az://`, `https://`, …)
through fsspec.

A location is a `Path` for a local file and a `str` with "://" for a URL: `Path("s3://b/k")`
would fold the "//" and lose the scheme, so a URL never becomes a Path (`location` parses what a
user typed). Local paths keep the plain `open` fast path; only URLs go through fsspec, and only
then is it imported. fsspec is a dependency; the protocol packages (s3fs, gcsfs, adlfs) are the
user's to install, and a missing one is named with the pip command (`StorageError`).

Endpoint and credentials are the protocol's own, as the user sets them for any other tool: for
S3, `AWS_ENDPOINT_URL` (a MinIO, a moto server), `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_PROFILE`, …, which botocore reads; any filesystem option as fsspec's
`FSSPEC_<PROTOCOL>_<OPTION>` environment variables or its config file (docs/jobs.md).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, BinaryIO
from urllib.parse import urlparse

from tokenmill.environment import readable_file, writable_file, writable_folder

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

Location = Path | str  # a local path, or a URL (a str with "://")

# The package fsspec needs for a protocol, for the message when it is missing.
PROTOCOL_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs",
                     "abfs": "adlfs", "abfss": "adlfs", "adl": "adlfs", "http": "aiohttp", "https": "aiohttp"}
READ_BUFFER = 1 << 20  # bytes: fsspec's own readline reads a whole block (MBs) per line; a BufferedReader does not


class StorageError(ValueError):
    """A location that cannot be used: an unknown protocol, or its package is not installed."""


def is_url(location: Location) -> bool:
    return isinstance(location, str) and "://" in location


def location(text: str) -> Location:
    """What a user typed (a flag's value): a URL stays a str, `file://` and anything else a Path."""
    if text.startswith("file://"):
        return Path(urlparse(text).path)
    return text if "://" in text else Path(text)


def suffix(location: Location) -> str:
    """The file's suffix, lowercased (".jsonl"): a URL's is its path's, query left out."""
    path = PurePosixPath(urlparse(location).path) if is_url(location) else Path(location)
    return path.suffix.lower()


def filesystem(url: str) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem of a URL and the path within it; StorageError naming what to install."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as exc:
        scheme = url.split("://", 1)[0].lower()
        package = PROTOCOL_PACKAGES.get(scheme)
        hint = f"pip install {package}" if package else "install the fsspec package for it"
        raise StorageError(f"{url}: {scheme}:// needs a package that is not installed ({hint}; fsspec says: "
                           f"{exc})") from None
    except ValueError as exc:  # "Protocol not known: foo"
        raise StorageError(f"{url}: {exc} (supported: any protocol fsspec knows, e.g. s3://, gs://, az://, "
                           "https://)") from None


def check(location: Location) -> None:
    """Refuse, before any work, a URL whose protocol cannot be used here (StorageError)."""
    if is_url(location):
        filesystem(str(location))


def check_input(location: Location, flag: str = "input") -> None:
    """Refuse, before any work, an input that cannot be read: a local file that is missing, a
    folder or unreadable (environment.PathError saying which), a URL whose protocol cannot be used.
    A URL's object is not looked up here: that is a round trip, and opening it says the same."""
    if is_url(location):
        filesystem(str(location))
    else:
        readable_file(Path(location), flag)


def check_output(location: Location, flag: str = "-o", is_file: bool = False) -> None:
    """Refuse, before any work, an output that cannot be written: a local folder (or, `is_file`,
    a file) where a file is in the way, or in a folder that cannot be written to; a URL whose
    protocol cannot be used. Nothing is created."""
    if is_url(location):
        filesystem(str(location))
    elif is_file:
        writable_file(Path(location), flag)
    else:
        writable_folder(Path(location), flag)


# ---- inputs ----------------------------------------------------------------------------------------
def input_exists(location: Location) -> bool:
    if not is_url(location):
        return Path(location).is_file()
    fs, path = filesystem(str(location))
    try:
        return bool(fs.isfile(path))
    except FileNotFoundError:
        return False


def open_input(location: Location) -> BinaryIO:
    """The input, open for binary reading (seekable); FileNotFoundError naming it if it is not there."""
    if not is_url(location):
        try:
            return Path(location).open("rb")
        except OSError:
            readable_file(Path(location), "input file")  # PathError saying why: missing, a folder, unreadable
            raise
    fs, path = filesystem(str(location))
    try:
        raw = fs.open(path, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"input file {location!r} not found") from None
    return io.BufferedReader(raw, READ_BUFFER)  # type: ignore[arg-type]  # fsspec files have readinto


def input_size(location: Location) -> int:
    if not is_url(location):
        return Path(location).stat().st_size
    fs, path = filesystem(str(location))
    try:
        return int(fs.size(path))
    except FileNotFoundError:
        raise FileNotFoundError(f"input file {location!r} not found") from None


# ---- an output folder ---------------------------------------------------------------------------------
class Store:
    """A folder of whole files, by name ("results/part-00001.jsonl"): a local folder, or a URL prefix
    on an object store.

    Nothing is ever appended or written in place. A file is committed whole: locally written to a
    temporary name beside it, fsynced and renamed; on an object store put as one object, which
    S3, GCS and Azure make visible all at once (a multipart upload only on its completion), so a
    reader sees the old file or the new one, never half of one. `scratch` is the local folder
    where a file for an object store is built first."""

    def __init__(self, root: Location, scratch: Path) -> None:
        self.root, self.scratch = root, scratch
        self._fs, base = filesystem(str(root)) if is_url(root) else (None, str(root))
        self._base = base.rstrip("/")

    @property
    def is_remote(self) -> bool:
        return self._fs is not None

    def url(self, name: str = "") -> str:
        """Where `name` is, for messages (the URL as the user wrote it, or the local path)."""
        root = str(self.root).rstrip("/")
        return f"{root}/{name}" if name else f"{root}/"

    def temp_path(self, name: str) -> Path:
        """A local file to build `name` in before `commit`: beside it locally (a rename is then
        atomic; the leading dot keeps dataset readers off it), else in the scratch folder."""
        folder = self._local(name).parent if self._fs is None else self.scratch
        folder.mkdir(parents=True, exist_ok=True)
        return folder / f".{PurePosixPath(name).name}.tmp"

    def commit(self, name: str, built: Path) -> None:
        """Make the local file `built` (from `temp_path`) the file `name`; `built` is gone after."""
        if self._fs is None:
            fsync(built)
            os.replace(built, self._local(name))
            return
        try:
            self._fs.put_file(str(built), self._path(name))
        finally:
            built.unlink(missing_ok=True)

    def put(self, name: str, data: bytes) -> None:
        built = self.temp_path(name)
        built.write_bytes(data)
        self.commit(name, built)

    def upload(self, name: str, local: Path) -> None:
        """Copy a local file (kept) to `name`: errors, summary and job.json of a URL output."""
        if self._fs is None:
            built = self.temp_path(name)
            shutil.copyfile(local, built)
            self.commit(name, built)
        else:
            self._fs.put_file(str(local), self._path(name))

    def get(self, name: str) -> bytes | None:
        """The file's bytes; None if there is none."""
        try:
            if self._fs is None:
                return self._local(name).read_bytes()
            return bytes(self._fs.cat_file(self._path(name)))
        except FileNotFoundError:
            return None

    def get_many(self, names: list[str]) -> dict[str, bytes]:
        """Several files at once (an object store fetches them concurrently)."""
        if self._fs is None:
            return {name: self._local(name).read_bytes() for name in names}
        if not names:
            return {}
        paths = {self._path(name): name for name in names}
        fetched = self._fs.cat(list(paths))
        return {paths[path]: bytes(data) for path, data in fetched.items()}

    def names(self, folder: str) -> list[str]:
        """The names of the files directly in `folder` ("results"), as "results/NAME"; [] if none."""
        if self._fs is None:
            local = self._local(folder)
            return sorted(f"{folder}/{p.name}" for p in local.iterdir() if p.is_file()) if local.is_dir() else []
        path = self._path(folder)
        self._fs.invalidate_cache(path)  # another machine may have written since this process listed it
        try:
            listed = self._fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(f"{folder}/{PurePosixPath(p).name}" for p in listed if str(p).rstrip("/") != path)

    def delete(self, names: Iterable[str]) -> None:
        for name in names:
            if self._fs is None:
                self._local(name).unlink(missing_ok=True)
                continue
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm_file(self._path(name))

    def _path(self, name: str) -> str:
        return f"{self._base}/{name}"

    def _local(self, name: str) -> Path:
        return Path(self._base) / name


def fsync(path: Path) -> None:
    """Make a local file's bytes durable (before a rename, or before a copy counts as committed)."""
    with path.open("rb") as f:
        os.fsync(f.fileno())


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[BinaryIO]:
    """Write a file whole or not at all: to `path`.tmp, which on success is synced and renamed over
    `path` (a crash, or an exception in the block, leaves the old file as it was)."""
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with tmp.open("wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: Path, data: bytes) -> None:
    with replacing(path) as f:
        f.write(data)


def atomic_write_json(path: Path, doc: dict[str, Any]) -> None:
    atomic_write(path, (json.dumps(doc, indent=2) + "\n").encode())
