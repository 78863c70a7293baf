"""Base images and the environment facts a stack image is judged by: every stack has a CPU base with its
Python, the debootstrap lines that make them (golden), the pinned archive keyring, and deviations from an
upstream's declared Python measured in the environment rather than declared."""

from __future__ import annotations

import hashlib
import http.server
import shlex
import subprocess
import threading
from pathlib import Path

import pytest
from conftest import matches_golden
from runner_kit.rollout import python_deviations

from runner._engines.images import Keyring, _keyring_file, base_for, debootstrap_command, load_bases
from runner.api import EngineError, UserError, all_stacks


def test_every_stack_has_a_cpu_base_with_its_python():
    for manifest in all_stacks().values():
        assert base_for(manifest, "cpu").python == manifest.python, manifest.name


def test_golden_debootstrap_lines_of_the_cpu_bases():
    lines = [shlex.join(debootstrap_command(base, Path("/scratch/rootfs"), Path("/scratch/keyring.gpg")
                                            if base.keyring else None))
             for base in load_bases().values() if base.flavour == "cpu"]
    matches_golden("debootstrap_cpu_bases.txt", "\n".join(lines) + "\n")


def test_a_keyring_that_is_not_a_table_of_deb_sha256_and_file_is_refused(tmp_path):
    bases = tmp_path / "bases.toml"
    bases.write_text('[cpu-x]\nflavour = "cpu"\npython = "3.12"\nkeyring = { deb = "http://x/k.deb" }\n')
    with pytest.raises(UserError, match=r"\[cpu-x\] keyring: expected a table with deb, sha256 and file"):
        load_bases(bases)


@pytest.fixture
def keyring_server(tmp_path):
    """A real HTTP server on 127.0.0.1 serving one keyring package made with dpkg-deb."""
    root = tmp_path / "pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text("Package: test-keyring\nVersion: 1\nArchitecture: all\n"
                                             "Maintainer: t <t@t>\nDescription: test\n")
    (root / "usr/share/keyrings").mkdir(parents=True)
    (root / "usr/share/keyrings/test.gpg").write_bytes(b"not really a key")
    served = tmp_path / "served"
    served.mkdir()
    subprocess.run(["dpkg-deb", "--build", str(root), str(served / "test-keyring.deb")], check=True,
                   capture_output=True)
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(served))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/test-keyring.deb", served / "test-keyring.deb"
    finally:
        server.shutdown()


def test_the_keyring_package_is_fetched_once_checked_and_unpacked(keyring_server, tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_CACHE_DIR", str(tmp_path / "cache"))
    url, package = keyring_server
    keyring = Keyring(deb=url, sha256=hashlib.sha256(package.read_bytes()).hexdigest(),
                      file="usr/share/keyrings/test.gpg")
    (tmp_path / "a").mkdir()
    assert _keyring_file(keyring, tmp_path / "a").read_bytes() == b"not really a key"
    package.unlink()  # the second base build uses the cached package
    (tmp_path / "b").mkdir()
    assert _keyring_file(keyring, tmp_path / "b").read_bytes() == b"not really a key"


def test_a_keyring_package_with_another_sha256_is_refused(keyring_server, tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_CACHE_DIR", str(tmp_path / "cache"))
    url, _ = keyring_server
    with pytest.raises(EngineError, match=r"test-keyring.deb: sha256 [0-9a-f]{64}, bases.toml pins 0{64}"):
        _keyring_file(Keyring(deb=url, sha256="0" * 64, file="usr/share/keyrings/test.gpg"), tmp_path)


def test_a_release_that_excludes_the_running_python_is_a_measured_deviation(tmp_path, monkeypatch):
    for name, declared in (("too-new", ">=3.99"), ("fits", ">=3.8"), ("bad-spec", "three")):
        info = tmp_path / f"{name.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
                                       f"Requires-Python: {declared}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = [line for line in python_deviations() if line.split()[0] in ("too-new", "fits", "bad-spec")]
    assert len(found) == 1 and found[0].startswith("too-new 1.0 declares Python >=3.99; runs on 3.")
