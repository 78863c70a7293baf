"""Pins: each stack's lock (resolved by pip with hashes) and its pin record (stacks/<name>/pins.json):
upstream name, version and git revision, Python version, the lock's sha256, and the images built from it.
`check_pins` compares them without running anything."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlparse

import msgspec

from runner_contracts import sha256_file, write_atomic

from ._engines.local import find_python
from ._errors import EngineError, UserError
from ._stacks import VCS_PIN, StackManifest, normalise, parse_lock, vcs_pins



class ImagePin(msgspec.Struct, kw_only=True):
    engine: str
    digest: str
    lock_sha256: str
    built_at: str


class PinRecord(msgspec.Struct, kw_only=True):
    stack: str
    upstream: str
    version: str
    git_revision: str | None = None
    git_revision_source: str | None = None  # the lock's VCS pin, a release tag, the distribution's metadata
    python: str
    lock_sha256: str
    resolver: str
    pinned_at: str
    images: dict[str, ImagePin] = msgspec.field(default_factory=dict)


def pin_command(manifest: StackManifest) -> str:
    if manifest.base:
        return f"runner pin --stack {manifest.base} --upstream {manifest.upstream.name}=={manifest.upstream.version}"
    return f"runner pin --stack {manifest.name}{' --gpu' if manifest.variant == 'gpu' else ''}"


def pin_path(manifest: StackManifest) -> Path:
    return manifest.pin_folder / manifest.pin_file


def read_pins(manifest: StackManifest) -> PinRecord | None:
    path = pin_path(manifest)
    if not path.is_file():
        return None
    try:
        return msgspec.json.decode(path.read_bytes(), type=PinRecord)
    except msgspec.ValidationError as error:
        raise UserError(f"{path}: {error}") from None
    except msgspec.DecodeError as error:
        raise UserError(f"{path}: not valid JSON ({error})") from None


def write_pins(manifest: StackManifest, record: PinRecord) -> Path:
    data = msgspec.json.format(msgspec.json.encode(record), indent=2) + b"\n"
    return write_atomic(pin_path(manifest), data)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def record_lock(manifest: StackManifest, resolver: str) -> PinRecord:
    """The pin record of the stack's current lock (image pins kept while they match the lock)."""
    previous = read_pins(manifest)
    images = {tag: pin for tag, pin in (previous.images if previous else {}).items()
              if pin.lock_sha256 == manifest.lock_sha256}
    revision, source = upstream_revision(manifest)
    record = PinRecord(stack=manifest.name, upstream=manifest.upstream.name, version=manifest.upstream.version,
                       git_revision=revision, git_revision_source=source, python=manifest.python,
                       lock_sha256=manifest.lock_sha256, resolver=resolver, pinned_at=_now(), images=images)
    write_pins(manifest, record)
    return record


def upstream_revision(manifest: StackManifest) -> tuple[str | None, str | None]:
    """(commit, where it came from) of the stack's upstream: the lock's VCS pin of it, else stack.toml's."""
    pinned = vcs_pins(manifest.lock).get(normalise(manifest.upstream.name)) if manifest.lock.is_file() else None
    if pinned:
        return pinned[1], f"{manifest.lock.name}: VCS pin {pinned[0]}@{pinned[1]}"
    return manifest.upstream.git_revision, manifest.upstream.git_revision_source


def record_image(manifest: StackManifest, engine: str, tag: str, digest: str, lock_sha256: str) -> None:
    """Adds a built image's digest to the pin record (the record is created if the stack has none)."""
    record = read_pins(manifest) or record_lock(manifest, resolver="recorded from the existing lock")
    record.images[tag] = ImagePin(engine=engine, digest=digest, lock_sha256=lock_sha256, built_at=_now())
    write_pins(manifest, record)


# --- resolving ---------------------------------------------------------------------------------------


def write_pin_set(manifest: StackManifest, requirement: str, log=lambda message: None) -> PinRecord:
    """A second pin set for the stack beside its own: pins/<version>/requirements.in (the stack's, with the
    upstream at `requirement`'s version), its lock resolved keeping every other version of the stack's
    lock where pip can (so only what the release needs moves), and its pins.json."""
    name, _, version = requirement.partition("==")
    if normalise(name) != normalise(manifest.upstream.name) or not re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", version):
        raise UserError(f"--upstream {requirement!r}: expected {manifest.upstream.name}==<version>")
    if version == manifest.upstream.version:
        raise UserError(f"--upstream {requirement}: that is the stack's own pin; `runner pin --stack {manifest.name}`")
    target = manifest.at_version(version)
    lines, found = [], False
    for line in manifest.requirements.read_text().splitlines():
        match = _REQUIREMENT.match(line)
        if match and normalise(match.group(1)) == normalise(name):
            line, found = f"{manifest.upstream.name}=={version}", True
        lines.append(line)
    if not found:
        raise UserError(f"{manifest.requirements}: does not pin {manifest.upstream.name}; nothing to move")
    target.requirements.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target.requirements, ("\n".join(lines) + "\n").encode())
    kept = "".join(f"{n}=={v}\n" for n, v in parse_lock(manifest.lock).items()
                   if n != normalise(name) and n not in vcs_pins(manifest.lock))
    try:
        return resolve_lock(target, log, constraints=kept)
    except EngineError:  # the release needs other versions of something the stack's lock pins
        log(f"{requirement} does not resolve beside the stack's other versions; resolving afresh")
        return resolve_lock(target, log, upgrade=True)


def resolve_lock(manifest: StackManifest, log=lambda message: None, *, upgrade: bool = False,
                 constraints: str | None = None) -> PinRecord:
    """Resolves requirements.in with pip's resolver on the stack's Python (no install: --dry-run
    --report) and writes the lock with sha256 hashes, then the pin record. The current lock's versions
    are kept as constraints (as pip-compile keeps them) unless `upgrade`."""
    requirements = manifest.requirements
    if not requirements.is_file():
        raise UserError(f"{requirements}: missing; list the stack's direct requirements there (name==version), "
                        "or record the current lock with `runner pin --no-resolve`")
    if constraints is None:
        constraints = "" if upgrade or not manifest.lock.is_file() else _bare_pins(manifest.lock)
    log(f"resolving {requirements}" + (f", keeping the versions in {manifest.lock.name}" if constraints else ""))
    installs, pip_version, python_version = _pip_report(manifest, ["-r", str(requirements)], constraints)
    lines = [f"# Lock for the {manifest.name} stack{' (GPU)' if manifest.variant == 'gpu' else ''}: written by "
             f"`runner pin` from {requirements.name}",
             f"# (pip {pip_version} resolver, Python {python_version}, {_now()}). Do not edit by hand.",
             f"# Installed with: pip install --no-deps --require-hashes -r {manifest.lock.name}"]
    lines += lock_lines(installs)
    write_atomic(manifest.lock, ("\n".join(lines) + "\n").encode())
    return record_lock(manifest, resolver=f"pip {pip_version} --dry-run --report, Python {python_version}")


def hash_lock(manifest: StackManifest, log=lambda message: None) -> PinRecord:
    """Records the current lock as it is (same distributions, same versions, its comments kept), adding
    the sha256 of every pin that has none (pip --no-deps --dry-run --report on the lock), then the pin record."""
    unhashed = unhashed_lines(manifest.lock)
    resolver = "recorded from the existing lock"
    if unhashed:
        log(f"hashing {len(unhashed)} pins of {manifest.lock}")
        installs, pip_version, python_version = _pip_report(manifest, ["--no-deps"], "",
                                                            requirements=_bare_pins(manifest.lock))
        hashes = {normalise(item["metadata"]["name"]): _sha256_of(item) for item in installs}
        lines = manifest.lock.read_text().splitlines()
        for number in unhashed:
            name = normalise(lines[number - 1].split("==", 1)[0].strip())
            lines[number - 1] = f"{lines[number - 1].rstrip()} --hash=sha256:{hashes[name]}"
        write_atomic(manifest.lock, ("\n".join(lines) + "\n").encode())
        resolver = f"the existing lock, hashed by pip {pip_version} --no-deps --dry-run --report, Python {python_version}"
    return record_lock(manifest, resolver=resolver)


def _bare_pins(lock: Path) -> str:
    """The lock's pins from an index as `name==version` lines: no hashes, no comments, no VCS pins (pip's
    constraints take no direct references; requirements.in names them)."""
    direct = vcs_pins(lock)
    return "".join(f"{name}=={version}\n" for name, version in parse_lock(lock).items() if name not in direct)


def _pip_report(manifest: StackManifest, args: list[str], constraints: str,
                requirements: str | None = None) -> tuple[list[dict], str, str]:
    """pip's installation report for the stack's lock, on the stack's Python."""
    interpreter, python_version = find_python(manifest.python)
    installs, pip_version = pip_report(interpreter, [*manifest.pip_args, *args], constraints=constraints,
                                       requirements=requirements, what=f"pip's report for the {manifest.name} lock")
    return installs, pip_version, python_version


def pip_report(interpreter: Path, args: list[str], *, constraints: str = "", requirements: str | None = None,
               what: str = "pip's report") -> tuple[list[dict], str]:
    """pip's installation report (nothing installed) on `interpreter`, in a scratch virtualenv:
    (the distributions it would install, pip's version)."""
    with tempfile.TemporaryDirectory(prefix="runner-pin-") as scratch:
        venv, report = Path(scratch) / "venv", Path(scratch) / "report.json"
        _run([str(interpreter), "-m", "venv", str(venv)], "creating a resolver virtualenv")
        pip = [str(venv / "bin" / "python"), "-m", "pip"]
        pip_version = _run([*pip, "--version"], "pip --version").split()[1]
        extra = []
        if constraints:
            (Path(scratch) / "constraints.txt").write_text(constraints)
            extra += ["-c", str(Path(scratch) / "constraints.txt")]
        if requirements is not None:
            (Path(scratch) / "requirements.txt").write_text(requirements)
            extra += ["-r", str(Path(scratch) / "requirements.txt")]
        _run([*pip, "install", "--dry-run", "--ignore-installed", "--quiet", "--disable-pip-version-check",
              "--report", str(report), *args, *extra], what)
        return json.loads(report.read_text())["install"], pip_version


def hashed_pins(installs: list[dict]) -> list[str]:
    """`name==version --hash=sha256:...` for each distribution of a pip report, sorted by name."""
    return [f"{item['metadata']['name']}=={item['metadata']['version']} --hash=sha256:{_sha256_of(item)}"
            for item in sorted(installs, key=lambda i: normalise(i["metadata"]["name"]))]


def lock_lines(installs: list[dict]) -> list[str]:
    """A stack lock's lines for a pip report: hashed pins, and a distribution that pip took from a git
    repository pinned to the commit it resolved (`name @ git+URL@sha  # version: X`)."""
    lines = []
    for item in sorted(installs, key=lambda i: normalise(i["metadata"]["name"])):
        info, name, version = item.get("download_info", {}), item["metadata"]["name"], item["metadata"]["version"]
        vcs = info.get("vcs_info")
        if vcs and vcs.get("vcs") == "git":
            url = re.sub(r"^file:///", "file://localhost/", info["url"])  # pip 23's parser wants a host here
            lines.append(f"{name} @ git+{url}@{vcs['commit_id']}  # version: {version}")
        else:
            lines.append(f"{name}=={version} --hash=sha256:{_sha256_of(item)}")
    return lines


def _sha256_of(item: dict) -> str:
    info = item.get("download_info", {})
    hashes = info.get("archive_info", {}).get("hashes", {})
    if "sha256" in hashes:
        return hashes["sha256"]
    url = urlparse(info.get("url", ""))
    if url.scheme == "file":  # a wheel from a local find-links folder: pip reports no hash
        return sha256_file(unquote(url.path))
    raise EngineError(f"pip reported no sha256 for {item['metadata']['name']} ({info.get('url')}); "
                      "a lock without a hash for every distribution cannot be installed in hash-checking mode")


def _run(cmd: list[str], what: str) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True, check=False,
                            env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-12:])
        raise EngineError(f"{what} failed (exit {result.returncode}):\n{tail}")
    return result.stdout


# --- checking ----------------------------------------------------------------------------------------


_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*==\s*([^\s;#]+)")


def unhashed_lines(lock: Path) -> list[int]:
    """Line numbers of the lock's pins that carry no sha256 hash (a VCS pin to a commit needs none)."""
    return [number for number, raw in enumerate(lock.read_text().splitlines(), start=1)
            if raw.split("#", 1)[0].strip() and "--hash=sha256:" not in raw and not VCS_PIN.match(raw)]


def check_pins(manifest: StackManifest) -> list[str]:
    """What drifted between the stack's files: stack.toml, requirements.in, the lock and pins.json.
    Empty when they agree."""
    locked = manifest.locked_packages()
    record = read_pins(manifest)
    where = pin_path(manifest)
    if record is None:
        return [f"{where}: missing; run `{pin_command(manifest)}`"]
    drift = []
    revision, _ = upstream_revision(manifest)
    expected = {"upstream": (record.upstream, manifest.upstream.name),
                "version": (record.version, manifest.upstream.version),
                "git_revision": (record.git_revision, revision),
                "python": (record.python, manifest.python)}
    drift += [f"{where}: {field} is {pinned!r}, stack.toml says {current!r}"
              for field, (pinned, current) in expected.items() if pinned != current]
    unhashed = unhashed_lines(manifest.lock)
    if unhashed:
        drift.append(f"{manifest.lock}:{unhashed[0]}: {len(unhashed)} of {len(locked)} pins have "
                     f"no --hash=sha256 (pip installs the lock in hash-checking mode); re-run "
                     f"`{pin_command(manifest)}`")
    if record.lock_sha256 != manifest.lock_sha256:
        drift.append(f"{manifest.lock}: sha256 {manifest.lock_sha256[:12]} differs from the pinned "
                     f"{record.lock_sha256[:12]} (re-run `{pin_command(manifest)}`)")
    upstream = normalise(manifest.upstream.name)
    from_git = vcs_pins(manifest.lock)
    if upstream in from_git and manifest.upstream.git_revision not in (None, from_git[upstream][1]):
        drift.append(f"{manifest.lock}: {upstream} is pinned to commit {from_git[upstream][1][:12]}, stack.toml's "
                     f"git_revision is {manifest.upstream.git_revision[:12]}")
    if upstream in locked and locked[upstream] != manifest.upstream.version:
        drift.append(f"{manifest.lock}: {upstream}=={locked[upstream]}, stack.toml pins {manifest.upstream.version}")
    requirements = manifest.requirements
    if requirements.is_file():
        for number, line in enumerate(requirements.read_text().splitlines(), start=1):
            direct = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*@\s*git\+", line)
            if direct and normalise(direct.group(1)) not in from_git:
                drift.append(f"{requirements}:{number}: {direct.group(1)} comes from git, the lock does not pin it "
                             f"to a commit (re-run `{pin_command(manifest)}`)")
            match = _REQUIREMENT.match(line)
            if match is None:
                continue
            name, version = normalise(match.group(1)), match.group(2)
            have = locked.get(name)
            if have is None:
                drift.append(f"{requirements}:{number}: {name}=={version} is not in the lock")
            elif have != version and have.split("+", 1)[0] != version:  # a local label (+cpu) is that version
                drift.append(f"{requirements}:{number}: {name}=={version}, the lock has {have}")
    return drift
