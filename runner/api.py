"""The public Python surface of the runner host, for scripts, tests and benchmarks. Everything else in
`runner` is private (underscore modules) and may change without notice.

    from runner.api import load_plan, get_stack, make_engine, resolve_policy, LocalEngine

Plans and stacks: load_plan, get_stack, all_stacks, load_manifest, parse_lock. Engines (the Engine
protocol): make_engine, LocalEngine, StackEnvironment, run_process, start_process_service, scrubbed_env.
Executors (the Executor protocol): make_executor. Policies: resolve_policy,
build_tiny. Files: validate_file, write_report, write_comparison, cache_dir. Errors: UserError (bad input,
exit 2), EngineError (an engine or upstream tool failed).
"""

from ._compare import write_comparison
from ._engines import Engine, make_engine
from ._engines.jobs import StackEnvironment, run_process, scrubbed_env, start_process_service
from ._engines.local import LocalEngine
from ._errors import EngineError, UserError
from ._executors import Executor, make_executor
from ._paths import cache_dir
from ._plan import load_plan
from ._policy import build_tiny, resolve_policy
from ._report import write_report
from ._stacks import StackManifest, all_stacks, get_stack, load_manifest, parse_lock
from ._validate import validate_file

__all__ = [
    "Engine", "EngineError", "Executor", "LocalEngine", "StackEnvironment", "StackManifest", "UserError",
    "all_stacks", "build_tiny", "cache_dir", "get_stack", "load_manifest", "load_plan", "make_engine",
    "make_executor", "parse_lock", "resolve_policy", "run_process", "scrubbed_env", "start_process_service",
    "validate_file", "write_comparison", "write_report",
]
