"""JSON Schemas generated from the record types: `python -m runner_contracts.schema OUT_DIR`.

contracts/schema/ holds the generated files; a test fails when they drift from the code.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec

from .records import RECORD_TYPES, SUPPORTED_VERSION


def schemas() -> dict[str, bytes]:
    """{file name: schema JSON bytes} for every contract record type."""
    out = {}
    for name, record_type in RECORD_TYPES.items():
        schema = msgspec.json.schema(record_type)
        schema["$id"] = f"runner-contracts/{name}.v{SUPPORTED_VERSION}.schema.json"
        schema["title"] = f"{name} (contract v{SUPPORTED_VERSION})"
        out[f"{name}.v{SUPPORTED_VERSION}.schema.json"] = (json.dumps(schema, indent=2, sort_keys=True) + "\n").encode()
    return out


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, data in schemas().items():
        (directory / name).write_bytes(data)
        written.append(directory / name)
    return written


if __name__ == "__main__":
    for path in write(Path(sys.argv[1] if len(sys.argv) > 1 else "contracts/schema")):
        print(path)
