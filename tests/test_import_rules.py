"""The layering, read from every import statement (lazy ones inside functions included):

- runner_contracts imports nothing of ours;
- qualification (tasks, gates, statistics) imports only contracts;
- runner_kit (what runs inside stack environments) imports only contracts and the task families;
- runner (the host) never imports a stack adapter, the kit, or an upstream package;
- a stack adapter imports contracts, the task families, the kit, its own package and third-party code,
  never the host, the gates or statistics, or another stack's adapter;
- nothing imports another package's private (underscore) module.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("runner_contracts", "qualification", "runner_kit", "runner")
HEAVY = {"torch", "transformers", "vllm", "ray", "datasets", "accelerate", "trl", "verl"}


def upstream_modules() -> set[str]:
    """Import names of every stack's upstream (distribution names with - and . as _), and the heavy stack."""
    names = set(HEAVY)
    for manifest in ROOT.glob("stacks/*/stack.toml"):
        upstream = tomllib.loads(manifest.read_text()).get("upstream", {}).get("name", "")
        names.add(upstream.lower().replace("-", "_").replace(".", "_"))
    return names - {""}


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file; relative imports stay inside their package."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def package_of(module: str) -> str:
    return module.split(".")[0]


def private(module: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in module.split(".")[1:])


def sources() -> dict[str, list[Path]]:
    """Our packages' source files, by the package that owns them."""
    owned = {
        "runner_contracts": sorted((ROOT / "contracts" / "src").rglob("*.py")),
        "qualification": sorted((ROOT / "qualification" / "src").rglob("*.py")),
        "runner_kit": sorted((ROOT / "kit" / "src").rglob("*.py")),
        "runner": sorted((ROOT / "runner").rglob("*.py")),
    }
    for adapter in sorted(ROOT.glob("stacks/*/adapter/src/runner_stack_*")):
        owned[adapter.name] = sorted(adapter.rglob("*.py"))
    return owned


def allowed(owner: str, module: str, upstreams: set[str]) -> str | None:
    """Why `owner` may not import `module` (None if it may)."""
    target = package_of(module)
    if target == owner:
        return None
    if private(module) and (target in OURS or target.startswith("runner_stack_")):
        return "a private module of another package"
    if owner == "runner_contracts" and (target in OURS or target.startswith("runner_stack_")):
        return "contracts imports nothing of ours"
    if owner == "qualification" and (target in OURS or target.startswith("runner_stack_")) \
            and target != "runner_contracts":
        return "qualification imports only contracts"
    if owner == "runner_kit" and (target in ("runner",) or target.startswith("runner_stack_")
                                  or module.startswith(("qualification.gates", "qualification.stats"))):
        return "the kit imports only contracts and the task families"
    if owner == "runner" and (target.startswith("runner_stack_") or target == "runner_kit" or target in upstreams):
        return "the host never imports a stack adapter, the kit or an upstream"
    if owner.startswith("runner_stack_") and (target == "runner" or target.startswith("runner_stack_")
                                              or module.startswith(("qualification.gates", "qualification.stats"))):
        return "a stack imports only contracts, the task families, the kit and its upstream"
    return None


def test_every_package_keeps_to_its_layer():
    upstreams = upstream_modules()
    violations = [f"{path.relative_to(ROOT)}:{line}: imports {module}: {why}"
                  for owner, paths in sources().items() for path in paths
                  for line, module in imports(path)
                  if (why := allowed(owner, module, upstreams))]
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize("owner, module, expected", [
    ("runner_contracts", "qualification.tasks", "contracts imports nothing of ours"),
    ("qualification", "runner._engine", "a private module of another package"),
    ("qualification", "runner_kit.rollout", "qualification imports only contracts"),
    ("runner", "runner_stack_trl.main", "the host never imports a stack adapter, the kit or an upstream"),
    ("runner", "torch", "the host never imports a stack adapter, the kit or an upstream"),
    ("runner_stack_openenv", "qualification.gates", "a stack imports only contracts, the task families, the kit and its upstream"),
    ("runner_stack_openenv", "runner_stack_trl.grpo", "a stack imports only contracts, the task families, the kit and its upstream"),
    ("runner_stack_openenv", "runner_kit.http._private", "a private module of another package"),
    ("runner_stack_openenv", "runner_kit.rollout", None),
    ("runner_stack_openenv", "openenv.core", None),
    ("runner", "runner._engine", None),
])
def test_the_rules_catch_what_they_name(owner, module, expected):
    assert allowed(owner, module, upstream_modules()) == expected
