"""A real Apptainer for the test suite (a TEST HARNESS: on a cluster the site's own `apptainer` is used).

Apptainer 1.4.5 comes from Debian sid, which this bookworm host cannot install (it needs libc6 >= 2.38),
so it runs from a minimal sid root filesystem made with debootstrap and cached under the runner cache by
its recipe. The launcher written here is what the engine calls in place of `apptainer` (RUNNER_APPTAINER,
`runner images export --apptainer`): it enters that root filesystem in a private mount namespace with
pivot_root (a plain chroot is refused as "weak"), binds in every host path its arguments name, and runs
apptainer as uid 1000, since Apptainer as root is refused here (the sandbox withholds a capability it
asks for) and clusters run it unprivileged too. A writable bind is opened to that user (chmod a+rwX),
which a cluster's shared file system does by ownership instead."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from runner._paths import cache_dir

SUITE = "sid"
PACKAGES = ["apptainer", "squashfs-tools", "squashfuse", "ca-certificates"]
USER_ID = 1000
RECIPE = f"debootstrap --variant=minbase --include={','.join(PACKAGES)} {SUITE}; runner uid {USER_ID}"

LAUNCHER = '''#!{python}
"""Written by tests/apptainer_host.py: runs `apptainer ARGS` from a sid root filesystem as uid {uid}.
A test harness only; on a cluster the site's own apptainer is used."""
import os
import subprocess
import sys
from pathlib import Path

ROOT, SCRATCH, UID = {root!r}, {scratch!r}, {uid}
ENTER = r"""
set -eu
root=$1; shift
mount --bind "$root" "$root"
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
mount --rbind /sys "$root/sys"
mount -t tmpfs tmpfs "$root/tmp"
binds=""
while [ "$1" != -- ]; do binds="$binds $1"; shift; done
shift
# Mount points first, each folder on their way open to the user (inside the root filesystem only: a host
# folder such as /root is 0700), then the binds.
for path in $binds; do
  mkdir -p "$root$path"
  folder=$path
  while [ "$folder" != / ]; do chmod o+rx "$root$folder"; folder=$(dirname "$folder"); done
done
for path in $binds; do mount --rbind "$path" "$root$path"; done
# Apptainer's build folders: under a path of their own (a build there fails to stat them under /root/...)
mkdir -p "$root/scratch"; mount --rbind "$SCRATCH" "$root/scratch"
cd "$root"; mkdir -p oldroot; pivot_root . oldroot; umount -l /oldroot
exec setpriv --reuid={uid} --regid={uid} --clear-groups apptainer "$@"
"""


def host_paths(args):
    """(folders to bind, those the job may write): every absolute host path an argument names, as itself
    when it is a folder, else its folder (a SIF, an archive, a SIF still to be built)."""
    binds, writable = set(), set()
    for index, arg in enumerate(args):
        value = arg.removeprefix("docker-archive://")
        path, _, mode = value.partition(":")
        if not path.startswith("/") or path.startswith(ROOT):
            continue
        folder = Path(path) if Path(path).is_dir() else Path(path).parent
        if folder == Path("/") or not folder.is_dir():
            continue
        binds.add(str(folder))
        if mode.endswith(":rw") or (args[:1] == ["build"] and index == next(
                (i for i, a in enumerate(args) if i > 0 and not a.startswith("-")), None)):
            writable.add(str(folder))
    return sorted(binds), writable


def open_to_user(folder):
    for where, dirs, files in os.walk(folder):
        os.chmod(where, os.stat(where).st_mode | 0o777)
        for name in files:
            path = os.path.join(where, name)
            if not os.path.islink(path):
                os.chmod(path, os.stat(path).st_mode | 0o666)


args = sys.argv[1:]
binds, writable = host_paths(args)
for folder in writable:
    open_to_user(folder)
environment = {{"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/home/runner", "LANG": "C.UTF-8",
               "APPTAINER_TMPDIR": "/scratch/tmp", "APPTAINER_CACHEDIR": "/scratch/cache", "SCRATCH": SCRATCH}}
sys.exit(subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", ENTER, "enter", ROOT,
                         *binds, "--", *args], env=environment).returncode)
'''


def missing() -> str | None:
    """Why no Apptainer can be set up here, or None."""
    if os.geteuid() != 0:
        return "making the sid root filesystem and entering it need root (debootstrap, unshare -m, pivot_root)"
    for tool in ("debootstrap", "unshare", "setpriv", "pivot_root"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make system-deps)"
    return None


def root_filesystem(log=print) -> Path:
    """The cached sid root filesystem with Apptainer, made once per recipe (~50 s)."""
    key = hashlib.sha256(RECIPE.encode()).hexdigest()[:16]
    root = cache_dir() / "apptainer" / f"rootfs-{key}"
    if (root / "usr" / "bin" / "apptainer").is_file():
        return root
    scratch = root.with_name(root.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.parent.mkdir(parents=True, exist_ok=True)
    log(f"making the Apptainer root filesystem: {RECIPE}")
    made = subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(scratch),
                           "http://deb.debian.org/debian"], capture_output=True, text=True)
    if made.returncode != 0:
        raise RuntimeError(f"debootstrap failed (exit {made.returncode}): {made.stdout[-2000:]}{made.stderr[-2000:]}")
    with open(scratch / "etc" / "passwd", "a") as passwd, open(scratch / "etc" / "group", "a") as group:
        passwd.write(f"runner:x:{USER_ID}:{USER_ID}::/home/runner:/bin/sh\n")
        group.write(f"runner:x:{USER_ID}:\n")
    for name in ("subuid", "subgid"):  # the user namespace Apptainer maps the caller into
        (scratch / "etc" / name).write_text("runner:100000:65536\n")
    (scratch / "home" / "runner").mkdir(parents=True)
    os.chown(scratch / "home" / "runner", USER_ID, USER_ID)
    shutil.copyfile("/etc/hosts", scratch / "etc" / "hosts")
    shutil.rmtree(scratch / "var" / "cache" / "apt", ignore_errors=True)
    scratch.rename(root)
    return root


def launcher(log=print) -> Path:
    """The launcher to use as the apptainer binary (written beside the root filesystem)."""
    root = root_filesystem(log)
    scratch = root.parent / "scratch"
    for name in ("tmp", "cache"):
        (scratch / name).mkdir(parents=True, exist_ok=True)
        os.chmod(scratch / name, 0o1777)
    path = root.parent / f"apptainer-{root.name.removeprefix('rootfs-')}"
    text = LAUNCHER.format(python=sys.executable, root=str(root), scratch=str(scratch), uid=USER_ID)
    if not path.is_file() or path.read_text() != text:
        partial = path.with_name(path.name + ".partial")
        partial.write_text(text)
        os.chmod(partial, 0o755)
        partial.replace(path)
    return path
