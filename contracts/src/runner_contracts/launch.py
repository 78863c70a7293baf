"""Adapter launcher: `python -m runner_contracts.launch MODULE:ATTR REQUEST_JSON`.

Runs the adapter in a child process under a supervisor (runner_contracts.processes.supervise), so that
nothing the adapter starts outlives the job. The child imports the adapter entry lazily, runs it on the
StageRequest and writes result.json to the request's out_dir. A failure is written as result.json with
`error` set, its traceback goes to stderr, exit 1.

The child then ends without the interpreter's teardown: its threads are joined and its atexit handlers
run as at any exit, but the modules are not finalized one by one, which takes a process that imported
torch and transformers about a second per job. An adapter closes the files it writes (the contract
writers do; a file left open is left .partial anyway).
"""

from __future__ import annotations

import gc
import importlib
import signal
import sys
import traceback
from pathlib import Path

from .io import RecordError, read_record, write_record
from .processes import die_with_parent, end_without_teardown, supervise
from .records import ErrorInfo, StageRequest, StageResult

RESULT_FILE = "result.json"
ADAPTER_FLAG = "--adapter-process"  # the supervised child: runs the adapter itself
# A full collection scans every live object. An adapter's start (torch, transformers, its upstream) makes
# hundreds of thousands that live as long as the job, and CPython 3.11 runs a full collection whenever 10
# middle ones have run and the survivors have grown by a quarter: six times in a trl probe's start, ~0.45 s of
# its ~3.7 s. With this, a full collection waits for 1000 middle ones; once the job's objects stop growing, full
# collections are rare anyway. The young and middle generations are collected as before.
OLDEST_GENERATION_THRESHOLD = 1000  # CPython's default: 10


def load_entry(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"adapter entry must look like 'module:function', got {spec!r}")
    return getattr(importlib.import_module(module_name), attr)


USAGE = "usage: python -m runner_contracts.launch MODULE:ATTR REQUEST_JSON"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    supervised = args[:1] == [ADAPTER_FLAG]
    if supervised:
        args = args[1:]
    if len(args) != 2:
        print(USAGE, file=sys.stderr)
        return 2
    if not supervised:
        # A sandbox may start us with SIGTERM ignored (so that it, our parent, outlives a graceful stop):
        # take the default back before the adapter inherits it, and stop when that parent dies.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        die_with_parent(signal.SIGTERM)
        return supervise([sys.executable, "-m", "runner_contracts.launch", ADAPTER_FLAG, *args])
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, OLDEST_GENERATION_THRESHOLD)
    end_without_teardown(run_adapter(args[0], Path(args[1])))


def run_adapter(entry: str, request_path: Path) -> int:
    """Runs the adapter entry on the request in this process; result.json either way."""
    try:
        request = read_record(request_path, StageRequest)
    except (OSError, RecordError) as error:
        print(f"cannot read stage request: {error}", file=sys.stderr)
        return 2
    out_dir = Path(request.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        result = load_entry(entry)(request)
        write_record(out_dir / RESULT_FILE, result)
    except Exception as error:  # the adapter's failure becomes evidence, not a lost traceback
        traceback.print_exc()
        write_record(out_dir / RESULT_FILE, StageResult(
            stage=request.stage, error=ErrorInfo(kind=type(error).__name__, message=str(error))))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
