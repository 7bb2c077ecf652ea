"""What a failing store prints on the training process's stderr: gcsfs logs every call that failed for good with
two chained tracebacks (``logger.exception``), calls this package stopped waiting for included, so a dead store
filled a job's output with 40-odd lines a call. They are one line each now; the caller's error is unchanged.

The store here is a real HTTP server that answers every request 400 (gcsfs's "non-retriable exception" path; its
"out of retries" path, the dead store's, takes gcsfs's six retries, about 30 s a call, and goes through the same
filter), read through real gcsfs, in a process of its own with no logging configured, as a training script runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import http.server, json, logging, os, sys, tempfile, threading
from pathlib import Path

class Refuse(http.server.BaseHTTPRequestHandler):
    def _answer(self):
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)
        body = json.dumps({"error": {"code": 400, "message": "refused by the test's store"}}).encode()
        self.send_response(400)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = do_PUT = do_DELETE = _answer
    def log_message(self, *a):
        pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
threading.Thread(target=server.serve_forever, daemon=True).start()
os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{server.server_address[1]}"
if sys.argv[1] == "debug":  # a user who asked for gcsfs's own detail keeps its traceback
    logging.getLogger("gcsfs").setLevel(logging.DEBUG)
    logging.basicConfig(level=logging.WARNING)
from resilient.checkpoint.storage.tiers import FsspecTier
f = Path(tempfile.mkdtemp()) / "f"
f.write_bytes(b"x" * 100)
for i in range(2):
    try:
        FsspecTier("gs://bkt/ck").put_file(1, "f", str(f))
    except Exception as e:
        print("raised", type(e).__name__, "refused by the test's store" in str(e), flush=True)
server.shutdown()
'''


def _run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    script = tmp_path / "store.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), mode], cwd=tmp_path, capture_output=True, text=True,
                          timeout=100, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


@pytest.mark.timeout(120)
def test_a_store_refusing_every_call_prints_one_line_a_call_and_the_caller_still_gets_the_error(tmp_path):
    r = _run(tmp_path, "quiet")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["raised HttpError True"] * 2, (r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 2 and all("non-retriable exception" in x and "refused by the test's store" in x
                                   for x in lines), r.stderr


@pytest.mark.timeout(120)
def test_gcsfs_at_debug_keeps_its_traceback(tmp_path):
    r = _run(tmp_path, "debug")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["raised HttpError True"] * 2, (r.stdout, r.stderr)
    assert r.stderr.count("non-retriable exception") == 2 and "Traceback" in r.stderr, r.stderr
