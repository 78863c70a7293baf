"""Secrets never reach what a run writes. A secret is the value of a variable named like one (HF_TOKEN,
WANDB_API_KEY, anything ending in _KEY, _TOKEN, _SECRET or _PASSWORD) or the credentials inside a URL
(https://user:token@host). Jobs never get the named ones (their environment is an allow-list); what the
host writes (evidence, reports, job logs, sbatch scripts) passes through `redact`."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

import msgspec

from runner_contracts import Record, write_atomic

SECRET_NAME = re.compile(r"^(HF_TOKEN|WANDB_API_KEY)$|_(KEY|TOKEN|SECRET|PASSWORD)$", re.IGNORECASE)
URL_CREDENTIALS = re.compile(r"(?P<scheme>\b[a-z][a-z0-9+.-]*://)[^/\s:@'\"]+(?::[^/\s@'\"]*)?@", re.IGNORECASE)
REDACTED = "[redacted]"


def is_secret(name: str, value: str) -> bool:
    return bool(SECRET_NAME.search(name) or URL_CREDENTIALS.search(value))


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of the secret-named variables set here, longest first (so no secret is left half-replaced)."""
    environ = os.environ if environ is None else environ
    return sorted({value for name, value in environ.items() if SECRET_NAME.search(name) and len(value) >= 4},
                  key=len, reverse=True)


def redact(text: str, environ: Mapping[str, str] | None = None) -> str:
    for value in secret_values(environ):
        text = text.replace(value, REDACTED)
    return URL_CREDENTIALS.sub(rf"\g<scheme>{REDACTED}@", text)


def redact_file(path: Path) -> None:
    """Rewrites a log the host did not write itself (a job's output) without its secrets, if it has any."""
    if not path.is_file():
        return
    text = path.read_bytes().decode("utf-8", "replace")
    redacted = redact(text)
    if redacted != text:
        write_atomic(path, redacted.encode())


def write_redacted(path: Path, text: str) -> Path:
    """Writes text the host made (a report, a script) atomically, without secrets."""
    return write_atomic(path, redact(text).encode())


def write_record_redacted(path: Path, record: Record) -> Path:
    """write_record, without secrets (evidence quotes adapter errors and logs)."""
    return write_redacted(path, msgspec.json.format(msgspec.json.encode(record), indent=2).decode() + "\n")
