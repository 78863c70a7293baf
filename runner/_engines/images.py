"""Stack images: base images made locally (debootstrap) or named by digest, one image per stack built
from images/stack.Containerfile, tagged by a content hash so an unchanged stack is never rebuilt.

Everything talks to the engine through the docker SDK, against a Docker Engine socket or Podman's
Docker-compatible socket (see `connect`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner_contracts import write_atomic

from .jobs import file_lock, tree_hash
from .._errors import EngineError, UserError
from .._file_hashes import cached_sha256
from .._paths import PROJECT_ROOT, cache_dir, local_packages
from .._stacks import StackManifest, normalise, vcs_pins

IMAGES_DIR = PROJECT_ROOT / "images"
STACK_DEFINITION = IMAGES_DIR / "stack.Containerfile"
LABEL_STACK = "runner.stack"
LABEL_LOCK = "runner.lock.sha256"
CONTAINER_ENGINES = ("docker", "podman")


# --- engines -----------------------------------------------------------------------------------------


def engine_url(engine: str) -> str:
    """The socket the docker SDK talks to: DOCKER_HOST / the default socket for docker;
    RUNNER_PODMAN_HOST, CONTAINER_HOST or Podman's default sockets for podman."""
    if engine == "docker":
        return os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if engine == "podman":
        for variable in ("RUNNER_PODMAN_HOST", "CONTAINER_HOST"):
            if os.environ.get(variable):
                return os.environ[variable]
        runtime = os.environ.get("XDG_RUNTIME_DIR")
        candidates = ([f"{runtime}/podman/podman.sock"] if runtime else []) + ["/run/podman/podman.sock"]
        return "unix://" + next((c for c in candidates if os.path.exists(c)), candidates[-1])
    raise UserError(f"--engine {engine!r}: container engines are {', '.join(CONTAINER_ENGINES)}")


def connect(engine: str) -> Any:
    """A docker SDK client for `engine`, checked to answer (and to be what it claims to be)."""
    import docker

    url = engine_url(engine)
    try:
        client = docker.DockerClient(base_url=url, timeout=900)
        version = client.version()
    except Exception as error:  # the SDK raises requests/urllib3/docker errors alike
        hint = ("start dockerd or point DOCKER_HOST at a running engine" if engine == "docker" else
                "start `podman system service --time=0 unix://...` and point RUNNER_PODMAN_HOST at it")
        raise EngineError(f"no {engine} engine answers at {url} ({type(error).__name__}); {hint}") from None
    is_podman = any("podman" in str(c.get("Name", "")).lower() for c in version.get("Components", []))
    if engine == "podman" and not is_podman:
        raise EngineError(f"{url} answers as a Docker Engine, not Podman; use --engine docker or another socket")
    return client


# --- base images -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Keyring:
    """An archive keyring debootstrap checks the suite's Release with, taken from a keyring package
    pinned by sha256 (the host's own keyrings are Debian's)."""

    deb: str  # the package's URL
    sha256: str
    file: str  # the keyring's path inside the package


@dataclass(frozen=True)
class BaseDefinition:
    name: str
    flavour: str  # cpu | gpu
    python: str
    suite: str | None = None
    mirror: str | None = None
    packages: tuple[str, ...] = ()
    components: tuple[str, ...] = ()
    script: str | None = None  # debootstrap's script, where the suite has none of its own
    keyring: Keyring | None = None
    image: str | None = None  # gpu: the CUDA image by digest
    definition: Path | None = None

    @property
    def key(self) -> str:
        recipe = [self.name, self.flavour, self.python, self.suite, self.mirror, list(self.packages), self.image]
        if self.components or self.script or self.keyring:  # only then: the other bases keep their keys (and caches)
            recipe += [list(self.components), self.script, self.keyring and self.keyring.sha256]
        digest = hashlib.sha256(json.dumps(recipe).encode())
        if self.definition is not None:
            digest.update(self.definition.read_bytes())
        return digest.hexdigest()[:16]

    @property
    def tag(self) -> str:
        return f"runner-base:{self.name}-{self.key}"


def load_bases(path: Path = IMAGES_DIR / "bases.toml") -> dict[str, BaseDefinition]:
    data = tomllib.loads(path.read_text())
    bases = {}
    for name, entry in data.items():
        missing = [key for key in ("flavour", "python") if key not in entry]
        if missing:
            raise UserError(f"{path}: [{name}] is missing {', '.join(missing)}")
        keyring = entry.get("keyring")
        if keyring is not None and not (isinstance(keyring, dict) and {"deb", "sha256", "file"} <= keyring.keys()):
            raise UserError(f"{path}: [{name}] keyring: expected a table with deb, sha256 and file")
        bases[name] = BaseDefinition(
            name=name, flavour=entry["flavour"], python=str(entry["python"]), suite=entry.get("suite"),
            mirror=entry.get("mirror"), packages=tuple(entry.get("packages", ())),
            components=tuple(entry.get("components", ())), script=entry.get("script"),
            keyring=Keyring(**{k: keyring[k] for k in ("deb", "sha256", "file")}) if keyring else None,
            image=entry.get("image"), definition=IMAGES_DIR / entry["definition"] if entry.get("definition") else None)
    return bases


def base_for(manifest: StackManifest, flavour: str) -> BaseDefinition:
    """The base of `flavour` for the stack's Python (a base with python = "*" builds any version)."""
    for base in load_bases().values():
        if base.flavour == flavour and base.python == manifest.python:
            return base
    for base in load_bases().values():
        if base.flavour == flavour and base.python == "*":
            return dataclasses.replace(base, python=manifest.python)
    offered = ", ".join(f"{b.name} (Python {b.python})" for b in load_bases().values() if b.flavour == flavour)
    raise UserError(f"stack {manifest.name} needs Python {manifest.python}; no {flavour} base in "
                    f"images/bases.toml provides it (have: {offered})")


def ensure_base(client: Any, base: BaseDefinition, log: Callable[[str], None]) -> str:
    """The base image's tag, made if missing: debootstrap + import for cpu, a build on the pinned CUDA
    image for gpu (which needs a registry)."""
    with _build_lock(base.tag):
        return _ensure_base(client, base, log)


def _ensure_base(client: Any, base: BaseDefinition, log: Callable[[str], None]) -> str:
    if _image_exists(client, base.tag):
        return base.tag
    if base.flavour == "gpu":
        return _build_gpu_base(client, base, log)
    rootfs = _debootstrap_tarball(base, log)
    log(f"importing base {base.tag} from {rootfs}")
    repository, tag = base.tag.split(":")
    reply = client.api.import_image_from_file(str(rootfs), changes=["ENV LANG=C.UTF-8", "CMD [\"/bin/bash\"]"])
    # Docker answers {"status": "sha256:..."}, Podman {"Id": ...}; tagging separately works for both.
    found = re.search(r"(sha256:)?[0-9a-f]{64}", reply if isinstance(reply, str) else json.dumps(reply))
    if found is None:
        raise EngineError(f"importing {rootfs}: the engine answered {reply!r}, not an image id")
    client.images.get(found.group(0)).tag(repository, tag)
    if not _image_exists(client, base.tag):
        raise EngineError(f"importing {rootfs} did not produce {base.tag}")
    return base.tag


def _debootstrap_tarball(base: BaseDefinition, log: Callable[[str], None]) -> Path:
    """A root filesystem tarball from Debian's packages, cached by the base's key (engines share it)."""
    target = cache_dir() / "images" / f"base-{base.name}-{base.key}.tar"
    if target.is_file():
        return target
    if shutil.which("debootstrap") is None:
        raise EngineError("debootstrap is not installed (Debian package debootstrap); it makes the CPU base image")
    if os.geteuid() != 0:
        raise EngineError("debootstrap needs root to make the CPU base image; run `runner images build` as root "
                          "once, or load a base image tagged " + base.tag)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix="rootfs-") as scratch:
        rootfs = Path(scratch) / "rootfs"
        log(f"debootstrap {base.suite} into {rootfs} (about a minute)")
        keyring = _keyring_file(base.keyring, Path(scratch)) if base.keyring is not None else None
        result = subprocess.run(debootstrap_command(base, rootfs, keyring), capture_output=True, text=True, check=False)
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).splitlines()[-10:])
            raise EngineError(f"debootstrap failed (exit {result.returncode}):\n{tail}")
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man"):
            for path in (rootfs / leftover).glob("*"):
                if path.is_file():
                    path.unlink()
                elif path.is_dir() and path.name != "partial":
                    shutil.rmtree(path, ignore_errors=True)
        partial = target.with_suffix(".partial")
        with tarfile.open(partial, "w") as archive:
            archive.add(rootfs, arcname=".")
        os.replace(partial, target)
    return target


def debootstrap_command(base: BaseDefinition, rootfs: Path, keyring: Path | None) -> list[str]:
    """The debootstrap line that makes a CPU base's root filesystem."""
    cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(base.packages)}"]
    if base.components:
        cmd.append(f"--components={','.join(base.components)}")
    if keyring is not None:
        cmd.append(f"--keyring={keyring}")
    cmd += [str(base.suite), str(rootfs), str(base.mirror)]
    if base.script:
        cmd.append(f"/usr/share/debootstrap/scripts/{base.script}")
    return cmd


def _keyring_file(keyring: Keyring, scratch: Path) -> Path:
    """The keyring file out of its package, fetched once into the cache and checked against its sha256."""
    package = cache_dir() / "images" / "keyrings" / f"{keyring.sha256}.deb"
    if not package.is_file():
        package.parent.mkdir(parents=True, exist_ok=True)
        try:
            with urllib.request.urlopen(keyring.deb, timeout=60) as reply:
                data = reply.read()
        except OSError as error:
            raise EngineError(f"fetching the archive keyring {keyring.deb}: {error}") from None
        if (found := hashlib.sha256(data).hexdigest()) != keyring.sha256:
            raise EngineError(f"{keyring.deb}: sha256 {found}, bases.toml pins {keyring.sha256}")
        write_atomic(package, data)
    unpacked = scratch / "keyring"
    subprocess.run(["dpkg-deb", "-x", str(package), str(unpacked)], check=True, capture_output=True)
    if not (unpacked / keyring.file).is_file():
        raise EngineError(f"{keyring.deb} holds no {keyring.file}")
    return unpacked / keyring.file


def _build_gpu_base(client: Any, base: BaseDefinition, log: Callable[[str], None]) -> str:
    assert base.definition is not None and base.image is not None
    with tempfile.TemporaryDirectory(prefix="runner-gpu-base-") as scratch:
        shutil.copy(base.definition, Path(scratch) / "Containerfile")
        _build(client, Path(scratch), base.tag, {"CUDA_IMAGE": base.image, "PYTHON": base.python}, log,
               pull=True)
    return base.tag


# --- stack images ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StackImage:
    """The image a stack runs in under a container engine."""

    stack: str
    tag: str
    digest: str  # the engine's content-addressed image id (sha256 of its config)
    python: str
    lock_sha256: str


def stack_definition(manifest: StackManifest) -> Path:
    own = manifest.folder / "Containerfile"
    return own if own.is_file() else STACK_DEFINITION


@functools.cache
def _find_links_folders() -> tuple[str, ...]:
    """pip's find-links folders (PIP_FIND_LINKS, then pip config); asked once per process."""
    folders = os.environ.get("PIP_FIND_LINKS", "").split()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        folders += subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                                  capture_output=True, text=True, timeout=20, check=False).stdout.split()
    return tuple(dict.fromkeys(folder.removeprefix("file://") for folder in folders))


def local_wheels(manifest: StackManifest) -> list[Path]:
    """Wheels of locked versions found in pip's find-links folders: releases that exist only on this
    machine, such as a CPU build of torch, go into the build context."""
    pins = manifest.locked_packages()
    found = []
    for folder in _find_links_folders():
        for wheel in sorted(glob.glob(os.path.join(folder, "*.whl"))):
            name, version = Path(wheel).name.split("-")[:2]
            if pins.get(normalise(name)) in (version, version.split("+", 1)[0]):
                found.append(Path(wheel))
    return found


def extra_ca_certificates(paths: list[Path] | None) -> list[Path]:
    """CA certificates added to the image: the ones given, else RUNNER_EXTRA_CA_CERTS (colon-separated),
    else this host's locally added ones (/usr/local/share/ca-certificates)."""
    if paths:
        certs = list(paths)
    elif os.environ.get("RUNNER_EXTRA_CA_CERTS"):
        certs = [Path(p) for p in os.environ["RUNNER_EXTRA_CA_CERTS"].split(":") if p]
    else:
        certs = sorted(Path("/usr/local/share/ca-certificates").glob("**/*.crt"))
    for cert in certs:
        if not cert.is_file():
            raise UserError(f"CA certificate {cert}: no such file")
    return certs


def context_inputs(manifest: StackManifest, base_tag: str, certs: list[Path], flavour: str = "cpu") -> dict[str, Any]:
    """What goes into a stack image's build. Local wheels only for CPU images: a GPU image takes the CUDA
    builds from the index (a local CPU build of torch would otherwise win on its +cpu label)."""
    if direct := vcs_pins(manifest.lock):
        raise UserError(f"{manifest.lock}: {', '.join(direct)} pinned from git; stack images install the lock in "
                        "hash-checking mode from the index only (git pins run under --engine local for now)")
    return {
        "definition": stack_definition(manifest),
        "wheels": local_wheels(manifest) if flavour == "cpu" else [],
        "certs": certs,
        "sources": {"contracts": local_packages()["runner-contracts"],
                    "qualification": local_packages()["runner-qualification"],
                    "kit": local_packages()["runner-kit"],
                    "adapter": manifest.adapter_package},
        "buildargs": {
            "BASE": base_tag, "STACK": manifest.name, "UPSTREAM": manifest.upstream.name,
            "UPSTREAM_VERSION": manifest.upstream.version, "UPSTREAM_REVISION": manifest.upstream.git_revision or "",
            "PYTHON": manifest.python, "LOCK_SHA256": manifest.lock_sha256, "PIP_ARGS": " ".join(manifest.pip_args),
        },
    }


def image_tag(manifest: StackManifest, inputs: dict[str, Any]) -> str:
    """runner-<stack>[-gpu]:<hash of the definition, lock, build args, wheels, certificates and our sources>."""
    digest = hashlib.sha256()
    digest.update(inputs["definition"].read_bytes())
    digest.update(manifest.lock_bytes())
    digest.update(json.dumps(inputs["buildargs"], sort_keys=True).encode())
    for path in [*inputs["wheels"], *inputs["certs"]]:
        digest.update(path.name.encode() + b"\0" + cached_sha256(path).encode())
    digest.update(tree_hash(list(inputs["sources"].values())).encode())
    return f"runner-{manifest.image_name}:{digest.hexdigest()[:16]}"


def build_stack_image(client: Any, manifest: StackManifest, *, flavour: str = "cpu",
                      certs: list[Path] | None = None, log: Callable[[str], None] = lambda m: None) -> StackImage:
    """Builds the stack's image unless an image with its content tag exists; returns it."""
    base = base_for(manifest, flavour)
    base_tag = ensure_base(client, base, log)
    inputs = context_inputs(manifest, base_tag, extra_ca_certificates(certs), flavour)
    tag = image_tag(manifest, inputs)
    with _build_lock(tag):  # a second runner building the same image waits, then finds it
        if not _image_exists(client, tag):
            log(f"building {tag} (base {base_tag})")
            with build_context(manifest, inputs) as context:
                _build(client, context, tag, inputs["buildargs"], log)
    return stack_image(client, tag)


def _build_lock(tag: str) -> contextlib.AbstractContextManager[None]:
    """One build of an image (or base) at a time on this host; engines publish a tag only when it is complete."""
    return file_lock(cache_dir() / "images" / "locks" / (re.sub(r"[^A-Za-z0-9_.-]", "_", tag) + ".lock"))


@contextlib.contextmanager
def build_context(manifest: StackManifest, inputs: dict[str, Any]) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix=f"runner-image-{manifest.name}-") as scratch:
        context = Path(scratch)
        shutil.copy(inputs["definition"], context / "Containerfile")
        shutil.copy(manifest.lock, context / "requirements.lock")
        for folder, files in (("wheels", inputs["wheels"]), ("certs", inputs["certs"])):
            (context / folder).mkdir()
            (context / folder / ".keep").write_text("")
            for path in files:
                if path.stat().st_dev == context.stat().st_dev:
                    os.link(path, context / folder / path.name)  # a 200 MB torch wheel: no copy
                else:
                    shutil.copy(path, context / folder / path.name)
        for name, source in inputs["sources"].items():
            shutil.copytree(source, context / "src" / name,
                            ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        yield context


def _build(client: Any, context: Path, tag: str, buildargs: dict[str, str], log: Callable[[str], None],
           pull: bool = False) -> None:
    """docker build through the API; pip inside needs the host network (no bridge on these hosts)."""
    log_path = cache_dir() / "images" / f"build-{tag.replace(':', '-').replace('/', '_')}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    error = None
    with open(log_path, "w") as handle:
        stream = client.api.build(path=str(context), dockerfile="Containerfile", tag=tag, buildargs=buildargs,
                                  network_mode="host", rm=True, forcerm=True, pull=pull, decode=True)
        for chunk in stream:
            if "stream" in chunk:
                handle.write(chunk["stream"])
            if "error" in chunk:
                error = chunk["error"]
                handle.write(f"ERROR: {error}\n")
    if error is not None:
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-12:])
        raise EngineError(f"building {tag} failed: {error.strip()} (log: {log_path})\n{tail}")
    log(f"built {tag} in {time.monotonic() - started:.0f} s (log: {log_path})")


def _image_exists(client: Any, reference: str) -> bool:
    import docker

    try:
        client.images.get(reference)
        return True
    except docker.errors.ImageNotFound:
        return False


def stack_image(client: Any, reference: str) -> StackImage:
    """An existing image, read back with its labels (refused if it is not a runner stack image)."""
    import docker

    try:
        image = client.images.get(reference)
    except docker.errors.ImageNotFound:
        raise UserError(f"image {reference!r} does not exist in this engine; `runner images list` shows "
                        "the stack images it has") from None
    labels = dict(image.labels or {})
    if LABEL_STACK not in labels:
        raise UserError(f"image {reference!r} carries no {LABEL_STACK} label: not built by `runner images build`")
    return StackImage(stack=labels[LABEL_STACK], tag=reference, digest=image.id, python=labels.get("runner.python", ""),
                      lock_sha256=labels.get(LABEL_LOCK, ""))


def list_stack_images(client: Any) -> list[dict[str, Any]]:
    rows = []
    for image in client.images.list(filters={"label": LABEL_STACK}):
        labels = image.labels or {}
        for tag in image.tags or ["<untagged>"]:
            rows.append({"stack": labels.get(LABEL_STACK), "tag": tag, "digest": image.id,
                         "size_mb": round(image.attrs.get("Size", 0) / 1e6, 1), "created": image.attrs.get("Created"),
                         "upstream": f"{labels.get('runner.upstream')}=={labels.get('runner.upstream.version')}",
                         "lock_sha256": labels.get(LABEL_LOCK, "")})
    return sorted(rows, key=lambda row: (row["stack"] or "", row["created"] or ""))


def save_docker_archive(client: Any, reference: str, target: Path) -> Path:
    """`docker save` of one image into a tar file (written atomically)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    with open(partial, "wb") as handle:
        for chunk in client.images.get(reference).save(named=True):
            handle.write(chunk)
    os.replace(partial, target)
    return target
