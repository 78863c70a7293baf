"""The host's CA certificates for a local job, as a directory OpenSSL reads lazily.

An HTTP client (httpx, the OpenAI SDK) builds its SSL context when it is made, a plain-HTTP loopback one
too. Given a bundle file (SSL_CERT_FILE, or certifi's when nothing is set), OpenSSL parses every certificate
in it: ~24 ms of CPU per client here, paid once per rollout by the arms whose programs make a client per
episode. Given a hashed directory (SSL_CERT_DIR, no SSL_CERT_FILE), it reads a certificate only when a TLS
handshake needs one: ~0.3 ms. So a local job gets the host's bundle as such a directory: the same
certificates, split one per file and named by `openssl rehash`, built once per bundle content. A job in a
stack image (Docker, Podman, Apptainer) gets the image's own hashed directory (IMAGE_CERTIFICATES)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from .._paths import cache_dir

_PEM = re.compile(rb"-----BEGIN (TRUSTED )?CERTIFICATE-----.+?-----END \1?CERTIFICATE-----", re.S)
_HASHED_NAME = re.compile(r"[0-9a-f]{8}\.\d+")


# A stack image's CA certificates: Debian's plus those added at build (images.extra_ca_certificates), hashed by
# the build's update-ca-certificates. The host's SSL_CERT_FILE names a host path, which the image may not have.
IMAGE_CERTIFICATES = {"SSL_CERT_DIR": "/etc/ssl/certs"}


def certificate_env() -> dict[str, str]:
    """SSL_CERT_DIR for a local job: the host's SSL_CERT_FILE as a hashed directory, else the host's
    SSL_CERT_DIR, else OpenSSL's default directory when it is hashed (so libraries that ship their own
    bundle, as httpx does certifi's, use the system's certificates). SSL_CERT_FILE as the host gives it
    when no directory can be made from it (no `openssl` on PATH, no certificate in the file)."""
    bundle = os.environ.get("SSL_CERT_FILE")
    if bundle:
        try:
            stat = os.stat(bundle)
        except OSError:
            return {"SSL_CERT_FILE": bundle}
        folder = _hashed_copy(os.path.abspath(bundle), stat.st_mtime_ns, stat.st_size)
        return {"SSL_CERT_DIR": str(folder)} if folder is not None else {"SSL_CERT_FILE": bundle}
    if os.environ.get("SSL_CERT_DIR"):
        return {"SSL_CERT_DIR": os.environ["SSL_CERT_DIR"]}
    import ssl  # ~3 ms, and only a host that sets neither variable needs it

    default = ssl.get_default_verify_paths().openssl_capath
    return {"SSL_CERT_DIR": default} if default and _is_hashed(Path(default)) else {}


@functools.cache
def _hashed_copy(bundle: str, mtime_ns: int, size: int) -> Path | None:
    """The bundle's certificates in a hashed directory under the user cache (None when none can be made);
    keyed by content, and by path, time and size for this process."""
    try:
        data = Path(bundle).read_bytes()
    except OSError:
        return None
    folder = cache_dir() / "ca-certificates" / hashlib.sha256(data).hexdigest()[:16]
    if folder.is_dir():  # renamed into place whole
        return folder
    openssl = shutil.which("openssl")
    certificates = [match.group(0) for match in _PEM.finditer(data)]
    if openssl is None or not certificates:
        return None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".build-", dir=folder.parent) as scratch:
            out = Path(scratch) / "out"
            out.mkdir()
            for index, certificate in enumerate(certificates):
                (out / f"{index:04d}.pem").write_bytes(certificate + b"\n")
            rehash = subprocess.run([openssl, "rehash", str(out)], capture_output=True)
            if rehash.returncode != 0 or not _is_hashed(out):
                return None
            with contextlib.suppress(OSError):  # another run renamed its copy in first
                out.rename(folder)
    except OSError:  # a cache that cannot be written: the job reads the bundle itself
        return None
    return folder if folder.is_dir() else None


def _is_hashed(folder: Path) -> bool:
    """Whether the folder holds certificates by subject hash (<8 hex digits>.<n>), as OpenSSL looks them up."""
    try:
        return any(_HASHED_NAME.fullmatch(name) for name in os.listdir(folder))
    except OSError:
        return False
