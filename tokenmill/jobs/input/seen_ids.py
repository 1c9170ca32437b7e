"""Which custom_ids a job has seen, and on which line, in ~12 bytes an id.

A set of a million Python strings costs ~100 MB and ten million ~1 GB; the job keeps a stable
64-bit hash of each id (`id_key`) and its line instead: a small dict of the newest ids, merged
every `FLUSH_EVERY` into sorted numpy arrays, one per hash partition so that no merge copies
more than a sixteenth of the whole. Two ids with the same 64-bit hash would be reported as a
duplicate (about one chance in 400,000 for ten million ids): a false refusal that names both
lines, never a row silently lost.
"""

from __future__ import annotations

import hashlib

import numpy as np

PARTITIONS = 16
FLUSH_EVERY = 1 << 16


def id_key(custom_id: str) -> int:
    """A custom_id's 64-bit key, the same in every process (Python's `hash` is salted per run);
    also what the done-index stores."""
    digest = hashlib.blake2b(custom_id.encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class SeenIds:
    def __init__(self) -> None:
        self._keys = [np.empty(0, np.int64) for _ in range(PARTITIONS)]
        self._lines = [np.empty(0, np.uint32) for _ in range(PARTITIONS)]
        self._recent: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._recent) + sum(len(k) for k in self._keys)

    def add(self, custom_id: str, line: int) -> int | None:
        """Record `custom_id` as seen on `line`; the line it was first seen on if it was already."""
        return self.add_key(id_key(custom_id), line)

    def add_key(self, key: int, line: int) -> int | None:
        first = self._recent.get(key)
        if first is None:
            first = self._find(key)
        if first is not None:
            return first
        self._recent[key] = line
        if len(self._recent) >= FLUSH_EVERY:
            self._flush()
        return None

    def seed(self, keys: np.ndarray, lines: np.ndarray) -> None:
        """Add many (key, line) pairs at once, known to be distinct (a resumed job's done rows)."""
        self._flush()
        self._merge(np.asarray(keys, np.int64), np.asarray(lines, np.uint32))

    def _find(self, key: int) -> int | None:
        part = key % PARTITIONS
        keys = self._keys[part]
        i = int(keys.searchsorted(key))
        if i < len(keys) and keys[i] == key:
            return int(self._lines[part][i])
        return None

    def _flush(self) -> None:
        if self._recent:
            keys = np.fromiter(self._recent.keys(), np.int64, len(self._recent))
            lines = np.fromiter(self._recent.values(), np.uint32, len(self._recent))
            self._recent = {}
            self._merge(keys, lines)

    def _merge(self, keys: np.ndarray, lines: np.ndarray) -> None:
        parts = keys % PARTITIONS
        for part in np.unique(parts):
            mine = parts == part
            new_keys, new_lines = keys[mine], lines[mine]
            order = np.argsort(new_keys, kind="stable")
            new_keys, new_lines = new_keys[order], new_lines[order]
            at = self._keys[part].searchsorted(new_keys)  # an O(n) insert, not a re-sort of everything
            self._keys[part] = np.insert(self._keys[part], at, new_keys)
            self._lines[part] = np.insert(self._lines[part], at, new_lines)
