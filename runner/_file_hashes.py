"""sha256 of large files (checkpoint weights, wheels, SIFs), remembered under the user cache.

A file is known again by what its file system says of it: path, device, inode, size, modification and
change times (no tool sets a change time, and a rewrite in place moves it). A later command that finds
the same file reads none of it: a 15 GB checkpoint is hashed once, not by every `runner qualify`. A file
changed in the last few seconds is hashed but not remembered: a rewrite within one tick of a coarse
file-system clock could keep its times."""

from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path

from runner_contracts import sha256_file, write_atomic

from ._paths import cache_dir

SETTLED_S = 2.0  # a file last changed this long ago is remembered
_SHA256 = re.compile(r"[0-9a-f]{64}")


def cached_sha256(path: Path) -> str:
    """The file's sha256, read from the cache when the file is the one it was hashed as."""
    key = _identity(path, os.stat(path))
    memo = cache_dir() / "file-hashes" / key
    try:
        known = memo.read_text()
    except OSError:
        known = ""
    if _SHA256.fullmatch(known):
        return known
    digest = sha256_file(path)
    after = os.stat(path)  # unchanged while it was read, and not changed just now
    if _identity(path, after) == key and time.time() - after.st_mtime > SETTLED_S:
        try:
            write_atomic(memo, digest.encode())
        except OSError:  # a cache that cannot be written costs a rehash next time, nothing else
            pass
    return digest


def _identity(path: Path, stat: os.stat_result) -> str:
    fields = (os.path.realpath(path), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    return hashlib.sha256("\0".join(map(str, fields)).encode()).hexdigest()[:32]
