"""Scratch storage for audits that must not grow with their input: an SQLite file in a temporary folder, a
set of keys that moves into one when it gets large, and worker results taken in order a few at a time."""

from __future__ import annotations

import collections
import multiprocessing.pool
import sqlite3
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any


class ScratchDatabase:
    """An SQLite file in a temporary folder that is deleted with this object: no journal, no fsync, one
    transaction left open (nothing is kept after the process); `db` is the connection, `schema` run on it."""

    def __init__(self, name: str, schema: str):
        self._folder = tempfile.TemporaryDirectory(prefix=f"runner-{name}-")
        self.db = sqlite3.connect(Path(self._folder.name) / f"{name}.sqlite", isolation_level=None)
        self.db.executescript(f"PRAGMA journal_mode = OFF; PRAGMA synchronous = OFF; {schema} BEGIN;")


class SeenIds:
    """Keys met so far: a set, moved into an SQLite file in a temporary folder once it holds `spill_at` keys,
    so a file of any size is checked for duplicates in bounded memory."""

    def __init__(self, spill_at: int = 400_000):
        self.spill_at = spill_at
        self._keys: set[str] = set()
        self._scratch: ScratchDatabase | None = None

    def __contains__(self, key: str) -> bool:
        if self._scratch is not None:
            return self._scratch.db.execute("SELECT 1 FROM seen WHERE key = ?", (key,)).fetchone() is not None
        return key in self._keys

    def add(self, key: str) -> bool:
        """True when `key` is new."""
        if self._scratch is not None:
            return self._scratch.db.execute("INSERT OR IGNORE INTO seen VALUES (?)", (key,)).rowcount == 1
        if key in self._keys:
            return False
        self._keys.add(key)
        if len(self._keys) >= self.spill_at:
            self._scratch = ScratchDatabase("seen", "CREATE TABLE seen (key TEXT PRIMARY KEY) WITHOUT ROWID;")
            self._scratch.db.executemany("INSERT INTO seen VALUES (?)", ((k,) for k in self._keys))
            self._keys = set()
        return True

    def add_many(self, keys: list[str]) -> list[int]:
        """Adds `keys` in order; returns the indices of those met before (in an earlier call or earlier here)."""
        if self._scratch is None and len(self._keys) + len(keys) < self.spill_at:
            batch = set(keys)
            if len(batch) == len(keys) and self._keys.isdisjoint(batch):
                self._keys |= batch
                return []
        return [index for index, key in enumerate(keys) if not self.add(key)]


def map_in_order(pool: multiprocessing.pool.Pool, function: Callable[[Any], Any], jobs: Iterable[Any],
                 window: int) -> Iterator[Any]:
    """function(job) for each job on the pool, yielded in order, at most `window` handed out and not yet
    taken, so a parent slower than its workers does not pile up their results in memory."""
    pending: collections.deque = collections.deque()
    for job in jobs:
        pending.append(pool.apply_async(function, (job,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()
