"""A real S3-compatible server for the object-storage checkpoint tests: versitygw (posix backend)
serving a temporary directory on loopback. Built from the Go module proxy by the pinned version
(`e2e/cluster/cluster.py build versitygw`, e2e/cluster/versions.env)."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _pinned_version() -> str:
    for line in (REPO / "e2e/cluster/versions.env").read_text().splitlines():
        if line.startswith("VERSITYGW_VERSION="):
            return line.split("=", 1)[1].strip()
    raise RuntimeError("VERSITYGW_VERSION missing from e2e/cluster/versions.env")


def versitygw_binary() -> str | None:
    """$VERSITYGW, else the pinned build in the cache, else `versitygw` on PATH; None if none."""
    if os.environ.get("VERSITYGW"):
        return os.environ["VERSITYGW"]
    cache = Path(os.environ.get("MEGATRON_OPERATOR_CACHE")
                 or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatron-operator")
    pinned = cache / "bin" / f"versitygw-{_pinned_version()}" / "versitygw"
    if os.access(pinned, os.X_OK):
        return str(pinned)
    return shutil.which("versitygw")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    root: Path
    proc: subprocess.Popen
    log: Path

    def credentials_file(self, path: Path, access_key: str | None = None, secret_key: str | None = None) -> Path:
        """An AWS shared-credentials file, the form the operator projects from the user's Secret."""
        path.write_text(f"[default]\naws_access_key_id = {access_key or self.access_key}\n"
                        f"aws_secret_access_key = {secret_key or self.secret_key}\n")
        path.chmod(0o600)
        return path

    def make_bucket(self, name: str) -> None:
        # The posix backend keeps a bucket as a top-level directory (plus its own xattrs), so the
        # bucket is made through the S3 API, as a user would.
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                     aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key).create_bucket(Bucket=name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(root: Path, binary: str) -> S3Server:
    port = _free_port()
    access, secret = "mo" + secrets.token_hex(8), secrets.token_hex(20)
    data = root / "data"
    data.mkdir(parents=True)
    log = root / "versitygw.log"
    # The root keys on the command line of a loopback test server are test-only; versitygw also
    # reads ROOT_ACCESS_KEY/ROOT_SECRET_KEY, used here so they do not show in `ps`.
    env = {**os.environ, "ROOT_ACCESS_KEY": access, "ROOT_SECRET_KEY": secret}
    proc = subprocess.Popen([binary, "--port", f"127.0.0.1:{port}", "posix", str(data)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"versitygw exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError(f"versitygw did not listen on 127.0.0.1:{port} in 20 s: {log.read_text()[-2000:]}")
    return S3Server(f"http://127.0.0.1:{port}", access, secret, root, proc, log)
