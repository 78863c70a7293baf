"""The stack registry: one stack.toml manifest per folder under stacks/. Nothing here imports upstream code."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from runner_contracts import StageName

from ._errors import UserError
from ._files import convert, load_toml, read_text, toml_line
from ._paths import stacks_dir


@dataclass(frozen=True)
class Upstream:
    name: str
    version: str
    git_revision: str | None = None
    git_revision_source: str | None = None  # where the commit was read (a tag, the distribution's metadata)


@dataclass(frozen=True)
class GpuVariant:
    """A stack's GPU environment: on GPU plans its training jobs (update, train, and so resume) run there."""

    lock: Path
    requirements: Path


@dataclass(frozen=True)
class StackManifest:
    name: str
    description: str
    python: str
    lock: Path
    adapter: str  # lazy "module:function" entry, resolved inside the stack environment
    adapter_package: Path
    upstream: Upstream
    stages: tuple[str, ...]
    capabilities: tuple[str, ...] = field(default_factory=tuple)
    policy_sources: tuple[Path, ...] = ()  # files the tiny-policy builder's output depends on
    folder: Path = Path()
    kind: str = "trainer"  # trainer: trains and hosts the environment itself; environment: a rollout service;
    # harness: an evaluation harness the evaluate stage runs against the served checkpoints (plan harnesses);
    # domain: trains and scores a non-language model natively (MACE, LeRobot) on a domain plan
    trainer: str | None = None  # for environment stacks: the trainer stack that drives them
    pip_args: tuple[str, ...] = ()  # extra arguments for installing the lock
    deviations: tuple[str, ...] = ()  # known departures from upstream's declared requirements (recorded in evidence)
    requirements: Path = Path("requirements.in")  # direct requirements `runner pin` resolves into the lock
    variant: str = "cpu"  # cpu, or gpu for the environment from [gpu] lock
    gpu: GpuVariant | None = None
    base: str | None = None  # for a pin set of another upstream version ("trl@1.15.0"): the stack's own name

    @property
    def is_environment(self) -> bool:
        return self.kind == "environment"

    @property
    def lock_sha256(self) -> str:
        return hashlib.sha256(self.lock_bytes()).hexdigest()

    def lock_bytes(self) -> bytes:
        """The lock's content; a stack folder without one yet is told how to make it."""
        try:
            return self.lock.read_bytes()
        except FileNotFoundError:
            raise UserError(f"{self.folder / 'stack.toml'}: field lock: {self.lock} does not exist; resolve it "
                            f"with `runner pin --stack {self.name}{' --gpu' if self.variant == 'gpu' else ''}`") from None

    def for_gpu(self) -> StackManifest:
        """The stack with its GPU lock (a trainer in its own right there); itself when it has none."""
        if self.gpu is None:
            return self
        return dataclasses.replace(self, lock=self.gpu.lock, requirements=self.gpu.requirements,
                                   variant="gpu", pip_args=())

    @property
    def pin_file(self) -> str:
        """Its pin record: pins.json, or pins-<variant>.json for another environment of the stack."""
        return "pins.json" if self.variant == "cpu" else f"pins-{self.variant}.json"

    @property
    def pin_folder(self) -> Path:
        """Where its lock's pin record lives: the stack folder, or pins/<version>/ for another pin set."""
        return self.lock.parent if self.base else self.folder

    @property
    def image_name(self) -> str:
        """The stack's name for its images and SIF files: <name>, or <name>-gpu for its GPU environment
        (a pin set's '@' becomes '-', which image tags allow)."""
        name = self.name.replace("@", "-")
        return name if self.variant == "cpu" else f"{name}-{self.variant}"

    def at_version(self, version: str) -> StackManifest:
        """The stack pinned to another release of its upstream: its pin set in pins/<version>/ (requirements.in,
        requirements.lock, pins.json, written by `runner pin --stack S --upstream NAME==VERSION`), as an arm
        named <stack>@<version>. At the stack's own version, the stack itself under that name."""
        if version == self.upstream.version:
            return dataclasses.replace(self, name=f"{self.name}@{version}")
        folder = self.folder / "pins" / version
        return dataclasses.replace(self, name=f"{self.name}@{version}", lock=folder / "requirements.lock",
                                   requirements=folder / "requirements.in", base=self.name, gpu=None,
                                   upstream=Upstream(name=self.upstream.name, version=version))

    def pin_sets(self) -> list[StackManifest]:
        """The stack at each other upstream version it has a pin set for."""
        return [self.at_version(path.name) for path in sorted((self.folder / "pins").glob("*/requirements.in"))
                for path in [path.parent]]

    def variants(self) -> list[StackManifest]:
        return [self] if self.gpu is None else [self, self.for_gpu()]

    def locked_packages(self) -> dict[str, str]:
        """name -> version from the lock (name normalised, local version label kept)."""
        self.lock_bytes()
        return parse_lock(self.lock)


# A lock line pinning a distribution to a git commit: `name @ git+URL@<40-hex sha>  # version: X` (pip
# cannot hash a repository, so the commit is the content address; the comment keeps the version).
VCS_PIN = re.compile(r"^\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*@\s*(?P<url>git\+\S+?)@(?P<commit>[0-9a-f]{40})"
                     r"\s*#\s*version:\s*(?P<version>\S+)\s*$")


def vcs_pins(path: Path) -> dict[str, tuple[str, str]]:
    """name (normalised) -> (git+URL, commit) of the lock's VCS pins."""
    return {normalise(m["name"]): (m["url"], m["commit"])
            for m in map(VCS_PIN.match, read_text(path, "lock").splitlines()) if m}


def parse_lock(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    for number, raw in enumerate(read_text(path, "lock").splitlines(), start=1):
        if vcs := VCS_PIN.match(raw):
            pins[normalise(vcs["name"])] = vcs["version"]
            continue
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if " @ " in line:
            raise UserError(f"{path}:{number}: a direct reference is pinned as 'name @ git+URL@<40-hex commit>  "
                            f"# version: X', got {raw!r}")
        name, sep, version = line.partition("==")
        if not sep:
            raise UserError(f"{path}:{number}: expected 'name==version', got {raw!r}")
        pins[normalise(name)] = version.split(";", 1)[0].split()[0]  # drops " --hash=sha256:..." too
    return pins


def normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")


class _UpstreamTable(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    version: str
    git_revision: str | None = None
    git_revision_source: str | None = None


class _GpuTable(msgspec.Struct, forbid_unknown_fields=True):
    lock: str
    requirements: str




class _ManifestFile(msgspec.Struct, forbid_unknown_fields=True):
    """stack.toml as written: the keys a manifest may have, with their types."""

    name: Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9-]*$")]
    description: str
    python: Annotated[str, msgspec.Meta(pattern=r"^3\.\d+$")]
    lock: str
    adapter: Annotated[str, msgspec.Meta(pattern=r"^[\w.]+:\w+$")]
    adapter_package: str
    upstream: _UpstreamTable
    stages: list[StageName]
    capabilities: list[str] = []
    policy_sources: list[str] = []
    kind: Literal["trainer", "environment", "harness", "domain"] = "trainer"
    trainer: str | None = None
    pip_args: list[str] = []
    deviations: list[str] = []
    gpu: _GpuTable | None = None


def load_manifest(path: Path) -> StackManifest:
    text, table = load_toml(path, "stack manifest")
    data = convert(table, _ManifestFile, path, text)
    if data.kind == "environment" and not data.trainer:
        raise UserError(f"{path}:{toml_line(text, 'kind')}: field trainer: an environment stack must "
                        "name the trainer stack that drives it")
    folder = path.parent
    return StackManifest(
        name=data.name,
        description=data.description,
        python=data.python,
        lock=folder / data.lock,
        adapter=data.adapter,
        adapter_package=folder / data.adapter_package,
        upstream=Upstream(name=data.upstream.name, version=data.upstream.version,
                          git_revision=data.upstream.git_revision or None,
                          git_revision_source=data.upstream.git_revision_source or None),
        stages=tuple(data.stages),
        capabilities=tuple(data.capabilities),
        policy_sources=tuple(folder / p for p in data.policy_sources),
        folder=folder,
        kind=data.kind,
        trainer=data.trainer,
        pip_args=tuple(data.pip_args),
        deviations=tuple(data.deviations),
        requirements=folder / "requirements.in",
        gpu=GpuVariant(lock=folder / data.gpu.lock, requirements=folder / data.gpu.requirements) if data.gpu else None,
    )  # a missing lock is reported where it is read: `runner pin` writes the first one


def all_stacks() -> dict[str, StackManifest]:
    manifests = {}
    for path in sorted(stacks_dir().glob("*/stack.toml")):
        stat = path.stat()
        manifest = _load_unchanged(path, stat.st_mtime_ns, stat.st_size)
        manifests[manifest.name] = manifest
    return manifests


@functools.lru_cache(maxsize=256)
def _load_unchanged(path: Path, mtime_ns: int, size: int) -> StackManifest:
    """load_manifest, once per version of the file: a command asks for the stacks several times."""
    return load_manifest(path)


def get_stack(name: str) -> StackManifest:
    """A stack by name; `<stack>@<version>` is the stack at that upstream release (its pin set)."""
    stacks = all_stacks()
    stack, _, version = name.partition("@")
    if stack not in stacks:
        raise UserError(f"unknown stack {stack!r}; known stacks: {', '.join(stacks) or '(none)'}")
    if not version:
        return stacks[stack]
    manifest = stacks[stack].at_version(version)
    if not manifest.lock.is_file():
        sets = ", ".join(m.upstream.version for m in stacks[stack].pin_sets()) or "none yet"
        raise UserError(f"stack {stack} has no pin set for {manifest.upstream.name} {version} (its own version is "
                        f"{stacks[stack].upstream.version}; pin sets: {sets}); write one with `runner pin --stack "
                        f"{stack} --upstream {manifest.upstream.name}=={version}`")
    return manifest
