"""Committed parts: a job's results on an object store (`-o s3://…`), or as parquet, written as the
job goes, with the local journal's exactly-once.

The journal (output.py: results.jsonl and its done-index) stays the source of truth while a job
runs, always on local disk: for a local `-o out/` it is out/results.jsonl, for a URL a spool
folder (`--spool-dir`, default `$TOKENMILL_CACHE/jobs/<sha256 of the URL>`). `PartSealer` cuts
it into parts: every `--part-rows` result rows, and at the end of every run (a stopped one
too), the journal's rows since the last part become the next one:

    OUT/results/part-00001.jsonl (or .parquet)   the rows, whole
    OUT/index/part-00001.index                   their done-index records (INDEX_RECORD,
                                                 the header's offset: where they start in the journal)

committed in that order. A part counts only once its sidecar exists; a data part without one
(a stop between the two writes) is deleted by the next run, which writes its rows again. Every
file is written whole (storage.Store): an object store makes a put visible at once, so no reader
ever sees half a part. The sidecars live in their own folder so that a dataset reader over
OUT/results/ sees only data.

A resume lists the sidecars: their records are the lines done (fed to `OutputState` as the
journal's own index would be). If this machine still has the journal, the rows after the last
part (a killed run's tail) are sealed first, then the job runs. A URL output's spool remembers
which part its journal follows (`parts.json`, written after each commit); a journal that does
not follow the last committed part (the spool is another machine's past, or a commit landed
but its note did not) is discarded, and what it held beyond the parts is run again. So only
committed parts count: a row is durable once its part is committed, a lost machine costs at
most --part-rows rows (or one run's tail) done again, and no row is ever in two parts. One run
at a time per output: on one machine a second run is refused (guard.OutputLock, on the spool
for a URL); two machines running the same URL output at once are not protected against.
"""

from __future__ import annotations

import hashlib
import json
import queue
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from tokenmill.environment import cache_root
from tokenmill.jobs import storage
from tokenmill.jobs.errors import JobError, JobFailed
from tokenmill.jobs.journal.guard import Footprint, with_temporaries
from tokenmill.jobs.journal.identity import check_same_job, claim_outputs
from tokenmill.jobs.journal.index import (
    INDEX_HEADER,
    INDEX_MAGIC,
    INDEX_RECORD,
    create_index,
    read_index,
    read_index_records,
)
from tokenmill.jobs.journal.paths import ERRORS_FILE, JOB_FILE, SUMMARY_FILE, OutputPaths
from tokenmill.jobs.journal.state import OutputState, count_done, scan_errors, scan_outputs
from tokenmill.jobs.journal.writers import IndexedResults
from tokenmill.jobs.storage import Location, Store, atomic_write_json

RESULTS, INDEX = "results", "index"  # the folders of the data parts and of their sidecars
PART_ROWS = 100_000  # result rows per committed part: what a lost machine can cost at most
MARKER = "parts.json"  # in a URL output's spool: the part its journal follows
_PART = re.compile(r"part-(\d+)\.(jsonl|parquet|index)$")
COPY_CHUNK = 8 << 20


@dataclass(frozen=True)
class Position:
    """How far the journal is sealed: the last part committed, and the journal's bytes and
    records up to the end of what is in parts."""

    part: int
    offset: int
    records: int


@dataclass(frozen=True)
class Committed:
    """What the output location holds: the highest part number committed, and the done-index
    records of all committed parts, in part order."""

    last: int
    records: np.ndarray


class PartStore:
    """A job's parts in its output location: listing what is committed, and committing one more."""

    def __init__(self, store: Store, fmt: str) -> None:
        self.store, self.format = store, fmt

    def data_name(self, number: int) -> str:
        return f"{RESULTS}/part-{number:05d}.{self.format}"

    @staticmethod
    def index_name(number: int) -> str:
        return f"{INDEX}/part-{number:05d}.index"

    def committed(self) -> Committed:
        """The committed parts (a data part without its sidecar is deleted: it never counted)."""
        sidecars = {n: name for n, name, ext in self._listed(INDEX) if ext == "index"}
        data = {n: name for n, name, ext in self._listed(RESULTS) if ext == self.format}
        self.store.delete(name for n, name in data.items() if n not in sidecars)
        missing = [n for n in sidecars if n not in data]
        if missing:
            data_url, sidecar_url = self.store.url(self.data_name(missing[0])), self.store.url(sidecars[missing[0]])
            raise JobError(f"{sidecar_url} has no data part ({data_url}); restore it, or use --overwrite to start over")
        numbers = sorted(sidecars)
        blobs = self.store.get_many([sidecars[n] for n in numbers])
        records = [_sidecar_records(blobs[sidecars[n]], self.store.url(sidecars[n])) for n in numbers]
        return Committed(max(numbers, default=0), np.concatenate(records) if records else np.empty(0, INDEX_RECORD))

    def exist(self) -> bool:
        return bool(self.store.names(RESULTS) or self.store.names(INDEX))

    def clear(self) -> None:
        """--overwrite: every part file goes (and nothing else in those folders)."""
        self.store.delete([name for folder in (RESULTS, INDEX) for _, name, _ in self._listed(folder)])

    def seal(self, journal: OutputPaths, position: Position, records: int, end: int) -> Position:
        """Commit the journal's records `position.records`..`records` (bytes `position.offset`..`end`)
        as the next part: the data, then its sidecar."""
        number = position.part + 1
        entries = read_index_records(journal.index, position.records, records)
        for path in (journal.index, journal.results):  # a part must hold no row the journal could still lose
            storage.fsync(path)
        built = self.store.temp_path(self.data_name(number))
        with built.open("wb") as f:
            self._write_rows(journal.results, position.offset, end, f)
        self.store.commit(self.data_name(number), built)
        header = INDEX_MAGIC + position.offset.to_bytes(8, "little")
        self.store.put(self.index_name(number), header + entries.tobytes())
        return Position(number, end, records)

    def _write_rows(self, journal: Path, start: int, end: int, f: BinaryIO) -> None:
        if self.format == "parquet":
            from tokenmill.jobs.journal.parquet import write_parquet  # pyarrow only for parquet jobs

            write_parquet(_journal_lines(journal, start, end), f)
            return
        with journal.open("rb") as src:  # JSONL: the journal's bytes as they are
            src.seek(start)
            left = end - start
            while left > 0 and (chunk := src.read(min(COPY_CHUNK, left))):
                f.write(chunk)
                left -= len(chunk)

    def _listed(self, folder: str) -> Iterator[tuple[int, str, str]]:
        for name in self.store.names(folder):
            match = _PART.search(name)
            if match:
                yield int(match.group(1)), name, match.group(2)


def _sidecar_records(blob: bytes, where: str) -> np.ndarray:
    if blob[:8] != INDEX_MAGIC or (len(blob) - INDEX_HEADER) % INDEX_RECORD.itemsize:
        raise JobError(f"{where} is not a tokenmill part index; use --overwrite to start over")
    return np.frombuffer(blob, INDEX_RECORD, offset=INDEX_HEADER)


def _journal_lines(path: Path, start: int, end: int) -> Iterator[bytes]:
    with path.open("rb") as f:
        f.seek(start)
        at = start
        while at < end and (line := f.readline()):
            at += len(line)
            yield line


class PartSealer:
    """Seals the journal into parts as `IndexedResults` writes it (Sealer): a part every
    `part_rows` rows, on a thread of its own so that no backend waits for an upload, and the rest
    at close. Only counts are handed over: a seal reads the rows back from the journal."""

    def __init__(
        self, parts: PartStore, journal: OutputPaths, position: Position, part_rows: int,
        on_commit: Callable[[Position], None], warn: Callable[[str], None],
    ) -> None:
        self.parts, self.journal, self.position, self.part_rows = parts, journal, position, part_rows
        self.on_commit, self.warn = on_commit, warn
        self._queued = position.records  # records handed to the thread so far
        self._queue: queue.Queue[tuple[int, int] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def wrote(self, records: int, end: int) -> None:
        if records - self._queued < self.part_rows:
            return
        self._queued = records
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tokenmill-parts", daemon=True)
            self._thread.start()
        self._queue.put((records, end))

    def close(self, records: int, end: int) -> None:
        """Seal what is left; JobFailed if it cannot be committed (the rows stay in the journal)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        try:
            self.seal(records, end)
        except Exception as exc:
            raise JobFailed(f"could not commit the last part to {self.parts.store.url(RESULTS)} ({exc}); its rows "
                            f"are kept in {self.journal.results}: re-run the same command on this machine to "
                            "commit them") from exc

    def seal(self, records: int, end: int) -> None:
        if records <= self.position.records:
            return
        self.position = self.parts.seal(self.journal, self.position, records, end)
        self.on_commit(self.position)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self.seal(*item)
            except Exception as exc:  # the next part (or the last, at close) takes these rows too
                self.warn(f"could not commit a part to {self.parts.store.url(RESULTS)} ({exc}); its rows stay "
                          "in the journal and go into the next part")


def default_spool(url: str) -> Path:
    """A URL output's local journal, one folder per output URL."""
    return cache_root() / "jobs" / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


@dataclass(frozen=True)
class OutputLayout:
    """Where a job's output goes and in what form: a JobConfig's output settings."""

    output: Location  # a folder or a results .jsonl file; a URL is a folder
    errors: Path | None = None
    output_format: str = "jsonl"  # the committed parts' format
    part_rows: int = PART_ROWS
    spool_dir: Path | None = None  # a URL output's local journal (default: under the cache folder)

    @property
    def writes_parts(self) -> bool:
        """Results sealed into committed parts: a URL output, or parquet."""
        return storage.is_url(self.output) or self.output_format == "parquet"


class JobOutput:
    """A job's files as the runner sees them: the local journal (`paths`) and, for a URL output or
    parquet, the committed parts (and, for a URL, the small files uploaded beside them)."""

    def __init__(self, layout: OutputLayout, say: Callable[[str], None] = lambda text: None) -> None:
        self.layout, self.say = layout, say
        self.remote = storage.is_url(layout.output)
        self.store: Store | None = None
        if self.remote:
            spool = layout.spool_dir or default_spool(str(layout.output))
            self.paths = OutputPaths.from_option(spool)
            self.store = Store(layout.output, scratch=spool)
        else:
            self.paths = OutputPaths.from_option(Path(layout.output), layout.errors)
            if layout.writes_parts:
                self.store = Store(layout.output, scratch=Path(layout.output))
        self.parts = PartStore(self.store, layout.output_format) if self.store is not None else None
        self.position = Position(0, 0, 0)

    @property
    def results_location(self) -> str:
        return str(self.paths.results) if self.parts is None else self.parts.store.url(RESULTS) + "/"

    @property
    def errors_location(self) -> str:
        return self.store.url(ERRORS_FILE) if self.remote and self.store else str(self.paths.errors)

    @property
    def _marker(self) -> Path:
        return self.paths.job.parent / MARKER

    def footprint(self) -> Footprint:
        """Every file and folder this job writes or deletes (`--overwrite` included)."""
        journal = Footprint(with_temporaries((*self.paths.files, self._marker) if self.remote else self.paths.files))
        if self.remote:
            assert self.store is not None
            small = tuple(self.store.url(name) for name in (ERRORS_FILE, SUMMARY_FILE, JOB_FILE))
            return journal + Footprint(small, (self.store.url(RESULTS), self.store.url(INDEX)))
        if storage.suffix(self.layout.output) == ".jsonl":
            return journal
        return journal + Footprint(folders=(Path(self.layout.output) / RESULTS, Path(self.layout.output) / INDEX))

    # ---- claiming ------------------------------------------------------------------------------
    def claim(self, job: dict[str, Any], overwrite: bool) -> bool:
        """Make the output this job's (claim_outputs); True when resuming an earlier run."""
        if not self.remote:
            if overwrite and storage.suffix(self.layout.output) != ".jsonl":  # a folder: parts of any format
                PartStore(Store(self.layout.output, Path(self.layout.output)), "jsonl").clear()
            return claim_outputs(self.paths, job, overwrite)
        assert self.store is not None and self.parts is not None
        if overwrite:
            self.parts.clear()
            self.store.delete([ERRORS_FILE, SUMMARY_FILE, JOB_FILE])
            self._wipe_spool()
        recorded = self.store.get(JOB_FILE)
        if recorded is not None:
            check_same_job(recorded, job, self.store.url(JOB_FILE), self.store.url())
        elif self.parts.exist() or self.store.get(ERRORS_FILE) is not None:
            raise JobError(f"{self.store.url()} holds a job's files but no {JOB_FILE}, so it was not started by this "
                           "job; choose another -o, or add --overwrite to replace them")
        if self.paths.job.exists() and json.loads(self.paths.job.read_bytes()).get("fingerprint") != job["fingerprint"]:
            self._wipe_spool()  # another job's journal (the output was started over from elsewhere)
        if not self.paths.job.exists():
            self.paths.job.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.paths.job, job)
        if recorded is None:
            self.store.upload(JOB_FILE, self.paths.job)
        return recorded is not None

    def _wipe_spool(self) -> None:
        p = self.paths
        for path in (p.results, p.index, p.errors, p.summary, p.job, p.backend_state, self._marker):
            path.unlink(missing_ok=True)

    # ---- resuming ------------------------------------------------------------------------------
    def scan(self) -> OutputState:
        """What earlier runs finished: the journal's index, or, with parts, the committed parts'
        (the journal's tail sealed first)."""
        if self.parts is None:
            return scan_outputs(self.paths)
        committed = self.parts.committed()
        journal, repaired = self._journal()
        position = None if journal is None else self._follows(committed, journal)
        if journal is None or position is None:  # a URL output's journal that is not the parts': redo what it held
            journal, position = self._restart_journal(committed.last), Position(committed.last, 0, 0)
        done = committed.records
        if len(journal) > position.records:  # a run that ended without sealing (killed): its tail first
            tail = journal[position.records:]
            position = self.parts.seal(self.paths, position, len(journal), int(tail["end"][-1]))
            self._note(position)
            self.say(f"committed {len(tail)} row(s) the last run left in its journal as "
                     f"{self.parts.store.url(self.parts.data_name(position.part))}")
            done = np.concatenate([done, tail])
        self.position = position
        state = OutputState(repaired_bytes=repaired)
        count_done(state, done)
        scan_errors(state, self.paths.errors)
        return state

    def _journal(self) -> tuple[np.ndarray | None, int]:
        """The journal's records (None: a URL output's journal that cannot be used) and bytes cut."""
        index, results = self.paths.index, self.paths.results
        if index.exists():
            found = read_index(index, results)
            if found is not None and found[1] == 0:
                return found[0], found[2]
        elif not (results.exists() and results.stat().st_size):
            create_index(index, 0)
            return np.empty(0, INDEX_RECORD), 0
        if self.remote:
            return None, 0
        raise JobError(f"{results} has rows its done-index {index.name} does not describe; use --overwrite to "
                       "start over")

    def _follows(self, committed: Committed, journal: np.ndarray) -> Position | None:
        """Where the committed parts end in this journal; None when they were not sealed from it."""
        if self.remote:
            try:
                note = json.loads(self._marker.read_bytes())
            except (FileNotFoundError, ValueError):
                return None
            if note.get("part") != committed.last:
                return None
            offset = int(note.get("offset", -1))
        else:
            offset = int(committed.records["end"][-1]) if len(committed.records) else 0
        ends = journal["end"]
        records = int(np.searchsorted(ends, offset, side="right"))
        if (records == 0 and offset == 0) or (records and int(ends[records - 1]) == offset):
            return Position(committed.last, offset, records)
        if self.remote:
            return None
        raise JobError(f"{self.paths.results} does not match its parts in {self._store_url(RESULTS)} "
                       "(it is shorter than they are); use --overwrite to start over")

    def _store_url(self, name: str) -> str:
        return self.store.url(name) if self.store is not None else name

    def _restart_journal(self, last_part: int) -> np.ndarray:
        """A new, empty journal after part `last_part`, with the output's errors file as it was uploaded."""
        assert self.store is not None
        for path in (self.paths.results, self.paths.index, self.paths.errors):
            path.unlink(missing_ok=True)
        create_index(self.paths.index, 0)
        errors = self.store.get(ERRORS_FILE)
        if errors is not None:
            self.paths.errors.write_bytes(errors)
        self._note(Position(last_part, 0, 0))
        return np.empty(0, INDEX_RECORD)

    def _note(self, position: Position) -> None:
        """A URL output's spool notes which part its journal follows, and where in it (after each
        commit, so a crash between the two leaves a note behind the parts: the journal is then
        discarded, never sealed twice)."""
        if self.remote:
            note = {"output": str(self.layout.output), "part": position.part, "offset": position.offset}
            atomic_write_json(self._marker, note)

    # ---- running -------------------------------------------------------------------------------
    def results(self, fsync_interval: float) -> IndexedResults:
        """The journal's writer; with parts, one that seals them as it goes."""
        sealer = None
        if self.parts is not None:
            sealer = PartSealer(self.parts, self.paths, self.position, self.layout.part_rows, self._note, self.say)
        return IndexedResults(self.paths.results, self.paths.index, fsync_interval, sealer)

    def publish(self, *files: Path) -> None:
        """A URL output: upload these small files of the spool (errors, summary) whole."""
        if not self.remote or self.store is None:
            return
        for path in files:
            if path.exists():
                self.store.upload(path.name, path)
