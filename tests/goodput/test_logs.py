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


def test_rate_limited_log_counts_what_it_holds_back():
    import logging

    from resilient.logs import RateLimitedLog

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("resilient.test.ratelimit")
    log.propagate = False
    log.addHandler(Keep())
    log.setLevel(logging.INFO)
    now = [100.0]
    rl = RateLimitedLog(log, 10.0, clock=lambda: now[0])
    assert rl.warning("refused pid %d", 1) is True
    for pid in range(2, 1002):
        assert rl.warning("refused pid %d", pid) is False
    assert records == ["refused pid 1"]
    now[0] += 10.0
    rl.warning("refused pid %d", 5000)
    assert records[-1] == "refused pid 5000 (and 1000 more like it in the last 10 s)"
    rl.warning("refused pid %d", 5001)
    rl.flush()
    assert len(records) == 2  # interval not over yet
    rl.flush(force=True)
    assert records[-1] == "1 more like this in the last 10 s; last: refused pid 5001" and rl.total == 1003
    with pytest.raises(ValueError):
        RateLimitedLog(log, 0)


def test_scrubbing_of_argv_env_and_text():
    from resilient.logs import is_secret_name, scrub_argv, scrub_env, scrub_text

    argv = ["resilient-run", "--nproc-per-node", "2", "train.py", "--hf-token", "hf_abc", "--api_key=sk-123",
            "--tokenizer", "gpt2", "--max-tokens", "10", "WANDB_API_KEY=w1", "--data", "gs://u:pw@bucket/x"]
    assert scrub_argv(argv) == ["resilient-run", "--nproc-per-node", "2", "train.py", "--hf-token", "***",
                                "--api_key=***", "--tokenizer", "gpt2", "--max-tokens", "10", "WANDB_API_KEY=***",
                                "--data", "gs://u:***@bucket/x"]
    assert scrub_env({"HF_TOKEN": "x", "PATH": "/bin", "AWS_SECRET_ACCESS_KEY": "y"}) == \
        {"HF_TOKEN": "***", "PATH": "/bin", "AWS_SECRET_ACCESS_KEY": "***"}
    text = scrub_text("started with --hf-token hf_abc DB_PASSWORD=pw1 Authorization: Bearer abcdefghijk --lr 0.1")
    assert "hf_abc" not in text and "pw1" not in text and "abcdefghijk" not in text and "--lr 0.1" in text
    assert not is_secret_name("--tokenizer") and not is_secret_name("RESILIENT_RUN_DIR")
    assert is_secret_name("apiKey") and is_secret_name("--client-secret") and is_secret_name("GITHUB_TOKEN")


def test_secrets_never_reach_the_ledger_the_logs_or_the_metrics(tmp_path):
    """A real run given a token as a script flag, in an assignment and in the environment, with debug logs."""
    import urllib.request
    from pathlib import Path

    from tests._helpers.gcs import free_port

    repo = Path(__file__).resolve().parents[2]
    secret = "s3cr3t-VALUE-9f8e7d"
    script = tmp_path / "train.py"
    script.write_text("import logging, sys\n"
                      "from resilient.logs import setup_logging\n"
                      "setup_logging('worker')\n"
                      "logging.getLogger('user').warning('args: %s', ' '.join(sys.argv[1:]))\n")
    run, port = tmp_path / "run", free_port()
    env = dict(os.environ, PYTHONPATH=str(repo), HF_TOKEN=secret, RESILIENT_LOG_LEVEL="DEBUG")
    r = subprocess.run([sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "1",
                        "--run-dir", str(run), "--metrics-port", str(port), str(script), "--hf-token", secret,
                        f"API_KEY={secret}"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    start = json.loads((run / "events.jsonl").read_text().splitlines()[0])
    assert start["kind"] == "run_start" and "--hf-token" in start["details"]["argv"]
    for path in run.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    assert secret not in r.stderr
    worker_log = (run / "logs" / "worker.jsonl").read_text()
    assert "args: --hf-token *** API_KEY=***" in worker_log  # the line is there, without the secret
    from resilient.goodput.metrics import MetricsServer

    with MetricsServer(0, str(run)) as srv:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=10) as resp:
            assert secret not in resp.read().decode()
