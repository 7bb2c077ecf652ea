"""resilient.logs.setup_logging in real processes: JSON lines in the run directory, readable on a terminal."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

MAIN = textwrap.dedent("""
    import logging, sys
    from resilient.logs import setup_logging

    def main():
        path = setup_logging("agent", run_dir=sys.argv[1], node="node-a", attempt=3)
        log = logging.getLogger("resilient.test")
        for i in range(int(sys.argv[2])):
            log.info("hello %d from %s", i, "agent", extra={"step": i})
        try:
            1 / 0
        except ZeroDivisionError:
            log.exception("it broke")
        logging.getLogger("noisy").debug("not shown at INFO")
        print(path, flush=True)

    if __name__ == "__main__":
        main()
""")


def run(tmp_path, n=3, **kw):
    env = dict(os.environ, RESILIENT_RUN_ID="run-42", RANK="0", COLUMNS="200")
    return subprocess.run([sys.executable, "-c", MAIN, str(tmp_path), str(n)], env=env, timeout=30, **kw)


def test_json_lines_with_context_and_plain_stderr(tmp_path):
    res = run(tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    path = tmp_path / "logs" / "agent.jsonl"
    assert res.stdout.strip() == str(path)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["message"] for r in recs] == ["hello 0 from agent", "hello 1 from agent", "hello 2 from agent",
                                           "it broke"]
    r = recs[0]
    assert (r["run_id"], r["node"], r["rank"], r["attempt"], r["role"]) == ("run-42", "node-a", 0, 3, "agent")
    assert r["level"] == "INFO" and r["logger"] == "resilient.test" and r["step"] == 0 and r["pid"] > 0
    assert "ZeroDivisionError" in recs[-1]["exc"] and recs[-1]["level"] == "ERROR"
    # not a terminal: plain human-readable lines
    assert "[agent]" in res.stderr and "INFO resilient.test: hello 1 from agent" in res.stderr
    assert "{" not in res.stderr.splitlines()[0]


def test_many_processes_share_one_file(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", MAIN, str(tmp_path), "300"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for _ in range(3)]
    for p in procs:
        assert p.wait(timeout=60) == 0
    lines = (tmp_path / "logs" / "agent.jsonl").read_text().splitlines()
    assert len(lines) == 3 * 301
    assert all(json.loads(line)["node"] == "node-a" for line in lines)


def test_rich_on_a_terminal(tmp_path):
    master, slave = pty.openpty()
    try:
        res = run(tmp_path, stdout=subprocess.PIPE, stderr=slave, text=True)
        os.close(slave)
        slave = -1
        out = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child side is closed and drained
                break
            if not chunk:
                break
            out += chunk
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)
    assert res.returncode == 0
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.decode(errors="replace"))
    assert "hello 2 from agent" in text and "[agent node-a r0]" in text
    assert '"message"' not in text  # human-readable, not JSON
