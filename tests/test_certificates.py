"""A local job gets the host's CA bundle as a hashed directory: the same certificates, trusted in a real TLS
handshake on 127.0.0.1, and an SSL context that no longer parses the whole bundle per HTTP client."""

from __future__ import annotations

import contextlib
import shutil
import socket
import ssl
import threading
from pathlib import Path

import pytest
from conftest import self_signed_certificate

from runner._engines import certificates
from runner._engines.certificates import certificate_env

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="needs the openssl CLI (makes the test certificates and the hashed directory)")


@pytest.fixture
def bundle(tmp_path, monkeypatch) -> tuple[Path, dict[str, tuple[Path, Path]]]:
    """A bundle of two self-signed certificates (text between them, as distribution bundles have), a third
    left out; SSL_CERT_FILE names the bundle and the user cache is under tmp_path."""
    made = {name: self_signed_certificate(tmp_path, name) for name in ("first", "second", "outsider")}
    path = tmp_path / "bundle.crt"
    path.write_text("# a comment\n" + made["first"][0].read_text() + "\nsecond:\n" + made["second"][0].read_text())
    monkeypatch.setenv("SSL_CERT_FILE", str(path))
    monkeypatch.setenv("RUNNER_CACHE_DIR", str(tmp_path / "cache"))
    certificates._hashed_copy.cache_clear()
    return path, made


def handshake(certificate: Path, key: Path, capath: str) -> None:
    """A TLS handshake with a server on 127.0.0.1 presenting `certificate`, verified against `capath`."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(certificate, key)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def serve() -> None:
            connection, _ = listener.accept()
            with connection, contextlib.suppress(ssl.SSLError, OSError):  # the client refused the certificate
                server.wrap_socket(connection, server_side=True).close()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            client = ssl.create_default_context(capath=capath)
            with (socket.create_connection(listener.getsockname(), timeout=10) as raw,
                  client.wrap_socket(raw, server_hostname="127.0.0.1")):
                pass
        finally:
            thread.join(10)


def test_a_bundle_becomes_a_hashed_directory_that_trusts_the_same_certificates(bundle, monkeypatch):
    path, made = bundle
    env = certificate_env()
    assert set(env) == {"SSL_CERT_DIR"}
    folder = Path(env["SSL_CERT_DIR"])
    assert folder.parent == path.parent / "cache" / "ca-certificates"
    handshake(*made["first"], str(folder))
    handshake(*made["second"], str(folder))
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(*made["outsider"], str(folder))
    rehashes = []
    run = certificates.subprocess.run
    monkeypatch.setattr(certificates.subprocess, "run", lambda *a, **k: rehashes.append(a) or run(*a, **k))
    certificates._hashed_copy.cache_clear()
    assert certificate_env() == env and not rehashes  # built once per content, found on disk by a fresh process
    path.write_text(path.read_text() + made["outsider"][0].read_text())
    changed = Path(certificate_env()["SSL_CERT_DIR"])
    assert changed != folder and len(rehashes) == 1
    handshake(*made["outsider"], str(changed))


def test_the_bundle_is_passed_as_given_when_no_directory_can_be_made(bundle, tmp_path, monkeypatch):
    path, _ = bundle
    with monkeypatch.context() as scoped:
        scoped.setenv("PATH", str(tmp_path / "no-tools-here"))  # no openssl to name the files by subject hash
        assert certificate_env() == {"SSL_CERT_FILE": str(path)}
    empty = tmp_path / "empty.crt"
    empty.write_text("no certificates in here\n")
    monkeypatch.setenv("SSL_CERT_FILE", str(empty))
    assert certificate_env() == {"SSL_CERT_FILE": str(empty)}
    monkeypatch.setenv("SSL_CERT_FILE", str(path))
    not_a_folder = tmp_path / "not-a-folder"
    not_a_folder.write_text("")
    monkeypatch.setenv("RUNNER_CACHE_DIR", str(not_a_folder / "runner"))  # the cache cannot be written
    certificates._hashed_copy.cache_clear()
    assert certificate_env() == {"SSL_CERT_FILE": str(path)}
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "missing.crt"))
    assert certificate_env() == {"SSL_CERT_FILE": str(tmp_path / "missing.crt")}


def test_without_a_bundle_the_host_directory_is_passed(tmp_path, monkeypatch):
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path))
    assert certificate_env() == {"SSL_CERT_DIR": str(tmp_path)}
