"""The upload process: a rank's bytes for the persistent tier sent from a process of its own.

Why: an upload's Python (the store client's requests, its event loop, the verification of every file as it is read)
needs the interpreter lock, and in the training process it takes it from the training thread. A GPU job's training
thread needs the lock for every kernel launch, so there it waits out each upload (measured on a launch-bound CPU
stand-in: a 37 MiB upload to a GCS emulator every 10 steps cost +49 % of the training thread's time from a thread,
+13 % from a process; ``bench/interference.py --store gcs``). The upload thread keeps everything that needs the job's
process group or the manager (the agreements, the commit, the events); this process only moves bytes
(:func:`~resilient.checkpoint.upload.send.send_files`) and codes them for a compressed upload
(:func:`~resilient.checkpoint.upload.stream.code_files`: the codec's threads and their Python off the training
process too).

It is started at the manager's first save (``python -m resilient.checkpoint.upload.process FD``, over a socket pair)
without waiting for it: its imports and its store client take 0.2-0.7 s, which that save's local write covers (a first
upload would otherwise wait for them while newer steps supersede the one waiting). It lives as long as the manager and
imports no torch. It tells the upload thread each file or part that landed (``on_landed``: the drill's mid-upload kill
fires there, in the training process, as it does on the thread's own sends). It ends when its socket closes, which the kernel does when the training
process ends, however it ends. What can go wrong, and what then happens:

* it cannot start, or cannot reach its store where the training process can (a filesystem registered only in the
  training process, storage options that cannot be pickled, a broken interpreter): the upload thread sends by itself
  for the rest of the run, with a warning; nothing is lost;
* it dies during an upload (killed, out of memory), or stops answering (stopped, stuck: the upload thread gives it
  the job's whole bound, :meth:`SendJob.deadline_s`, then kills it): the upload thread sends that step itself, with a
  warning, and the next upload starts a new process; after :data:`MAX_DEATHS` such failures in a row the upload
  thread sends by itself for the rest of the run;
* a newer step waits: the thread tells it to stop retrying, as the thread itself would; the manager's exit kills it.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from resilient.checkpoint.api import CheckpointError
from resilient.checkpoint.storage.priority import lower_thread_priority
from resilient.checkpoint.storage.tiers import BoundedTier, make_tier
from resilient.checkpoint.upload.send import SendJob, send_files
from resilient.checkpoint.upload.stream import CodeJob, Streamed, code_files

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 60.0  # a start-up that takes longer (imports from a cold disk): the thread sends instead
MAX_DEATHS = 2  # deaths in a row during uploads after which the thread sends by itself
_POLL_S = 0.05
# the tier's calls the upload process makes besides sending files: an upload's metadata calls (the commit marker
# removed and written, the step listed and swept, retention), each a request to the store with its client's Python
CALLS = frozenset({"write_bytes", "delete_file", "list_files", "steps", "delete_step"})
# filesystems that live inside one process: another process would upload into its own copy
IN_PROCESS_PROTOCOLS = frozenset({"memory"})
# cores a local rank needs for ``upload_process="auto"`` to start its upload process: one for training, one for the
# process; with fewer, the process takes a core training would have had (2 ranks on 2 cores, measured: no gain on the
# model's own step, and 2 points of headline goodput lost beside a CPU burner)
CORES_PER_RANK = 2


class SenderUnavailable(CheckpointError):
    """The upload process cannot be used for this run; the upload thread sends by itself."""


class SenderDied(CheckpointError):
    """The upload process ended during an upload; that upload failed, the next one starts a new process."""


@dataclass(frozen=True)
class TierSpec:
    """The persistent tier as the upload process builds it: the manager's own construction, bounded calls included."""

    url: str
    name: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 30.0
    min_rate: float = float(8 << 20)  # bytes/s a call is given time for on top of timeout_s (BoundedTier's own)
    # the checkpoint threads' nice value (``CheckpointConfig.background_nice``), the whole process's here
    nice: int | str = 0

    def build(self) -> Any:
        return BoundedTier(make_tier(self.url, self.name, self.storage_options), self.timeout_s, self.min_rate)

    @property
    def in_process(self) -> bool:
        """The tier lives inside the training process (``memory://``): by design never sent from another."""
        return (urlsplit(self.url).scheme if "://" in self.url else "") in IN_PROCESS_PROTOCOLS

    def why_not(self) -> str | None:
        """Why this tier cannot be reached from another process, or None."""
        scheme = urlsplit(self.url).scheme if "://" in self.url else ""
        if self.in_process:
            return f"{scheme}:// lives inside the training process"
        try:
            pickle.dumps(self)
        except Exception as e:  # any object a user put in storage_options
            return f"its storage options cannot be sent to another process ({type(e).__name__}: {e})"
        return None


# a container's CPU limit (Kubernetes' resources.limits.cpu): a quota over a period, cgroup v2's file, then v1's pair
CGROUP_V2_CPU_MAX = "/sys/fs/cgroup/cpu.max"
CGROUP_V1_CPU = ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def available_cores(cpu_max: str = CGROUP_V2_CPU_MAX, v1: tuple[str, str] = CGROUP_V1_CPU) -> float:
    """The cores this process may use: its affinity (which a launcher's NUMA binding narrows), or its container's CPU
    quota where that is lower (a pod limited to 16 CPUs on a 192-core host sees all 192 in its affinity)."""
    try:
        n: float = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        n = os.cpu_count() or 1
    quota: float | None = None
    try:
        q, period = Path(cpu_max).read_text().split()[:2]
        quota = None if q == "max" else int(q) / int(period)
    except (OSError, ValueError):
        try:
            q1, p1 = (int(Path(f).read_text().strip()) for f in v1)
            quota = q1 / p1 if q1 > 0 and p1 > 0 else None  # -1: no limit
        except (OSError, ValueError):
            pass
    return min(n, quota) if quota is not None and quota > 0 else n


def use_process(setting: bool | str, local_ranks: int, cores: float | None = None) -> tuple[bool, str]:
    """Whether uploads go from an upload process (``CheckpointConfig.upload_process``: True, False or "auto"), and
    why, in words for the log."""
    if setting is True:
        return True, "on (--ckpt-upload-process on)"
    if setting is False:
        return False, "off (--ckpt-upload-process off)"
    cores = available_cores() if cores is None else cores
    ranks = max(int(local_ranks), 1)
    if cores >= CORES_PER_RANK * ranks:
        return True, f"auto: {cores:g} cores for {ranks} local rank(s)"
    return False, (f"auto: {cores:g} core(s) for {ranks} local rank(s), fewer than {CORES_PER_RANK} a rank, where an "
                   "upload process would take a core from training (--ckpt-upload-process on to use it anyway)")


class SendProcess:
    """The upload thread's handle on its upload process: one job at a time, from that thread only."""

    def __init__(self, spec: TierSpec, python: str | None = None, ready_timeout_s: float = READY_TIMEOUT_S):
        self.spec, self.python = spec, python or sys.executable
        self.ready_timeout_s = ready_timeout_s
        self.off: str | None = spec.why_not()  # set once the process is not to be used again: why
        self.deaths = 0  # in a row, during uploads
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._ready = False  # the process said it reached its store
        # called on the upload thread with (step, name) for each file or part the process put on the store
        self.on_landed: Callable[[int, str], None] | None = None
        # called once for each failure of the process as it is found (a death, an end between uploads, the process
        # turned off for the run), with the error the caller is about to see and the step being uploaded (or None):
        # the uploader writes it to the ledger, where a WARNING line alone would be seen by nobody who counts
        self.on_failure: Callable[[CheckpointError, int | None], None] | None = None
        self._killed = False  # kill() ended it on purpose (exit): not a failure to report
        self._lock = threading.Lock()  # kill() comes from other threads

    @property
    def pid(self) -> int | None:
        p = self._proc
        return p.pid if p is not None and p.poll() is None else None

    def send(self, job: SendJob, should_stop: Callable[[], bool]) -> int:
        """Run ``job`` in the process; returns the bytes sent, raises what the store raised there. Raises
        :class:`SenderUnavailable` when the process cannot be used (the caller then sends by itself), and
        :class:`SenderDied` when it died or stopped answering."""
        bound = job.deadline_s(self.spec.timeout_s, self.spec.min_rate)
        return int(self._run(("send", job), job.step, bound, should_stop, f"the upload of step {job.step}"))

    def code(self, job: CodeJob, should_stop: Callable[[], bool]) -> Streamed:
        """Code and send ``job`` in the process (a compressed upload's bytes); raises as :meth:`send`."""
        bound = job.deadline_s(self.spec.timeout_s, self.spec.min_rate)
        out = self._run(("code", job), job.step, bound, should_stop, f"the compressed upload of step {job.step}")
        if not isinstance(out, Streamed):
            raise CheckpointError(f"the upload process answered a compressed upload with {type(out).__name__}")
        return out

    def call(self, name: str, *args: Any) -> Any:
        """One call of the tier's (``name`` in :data:`CALLS`) made in the process; raises as :meth:`send`."""
        if name not in CALLS:
            raise ValueError(f"{name!r} is not a tier call the upload process makes ({', '.join(sorted(CALLS))})")
        # the process bounds the call itself (its tier is bounded); this bound only catches a process that stopped
        bound = 2 * (self.spec.timeout_s + 5.0) + sum(len(a) for a in args if isinstance(a, bytes)) / self.spec.min_rate
        step = next((a for a in args if isinstance(a, int)), -1)
        return self._run(("call", name, args), step, bound, lambda: False, f"{name}() for step {step}")

    def _run(self, msg: tuple[Any, ...], step: int, bound: float, should_stop: Callable[[], bool], what: str) -> Any:
        if self.off is not None:
            raise SenderUnavailable(self.off)
        conn = self.start()
        deadline = time.monotonic() + bound
        told_stop = False
        why: str | None = None
        try:
            conn.send(msg)
            while True:
                if conn.poll(_POLL_S):
                    kind, payload = conn.recv()
                    self.deaths = 0
                    if kind == "landed":
                        if self.on_landed is not None:
                            self.on_landed(step, payload)
                        continue
                    break
                if self._proc is None or self._proc.poll() is not None:
                    raise EOFError
                if not told_stop and should_stop():
                    conn.send(("stop", step))
                    told_stop = True
                if time.monotonic() > deadline:
                    why = f"sent nothing back within its bound of {bound:.0f} s (stopped or stuck?) and was killed"
                    self._kill()
                    raise EOFError
        except (EOFError, OSError) as e:
            pid = self._proc.pid if self._proc is not None else None
            code = self._reap()
            self.deaths += 1
            why = why or f"died ({_how(code)})"
            if self.deaths >= MAX_DEATHS:
                self.off = f"the upload process failed {self.deaths} times in a row (last: it {why})"
            died = SenderDied(f"the upload process (pid {pid}) {why} during {what}; "
                              + ("uploads are sent from the training process from now on" if self.off else
                                 "the next upload starts a new one"))
            if not self._killed:
                self._tell(died, step if step >= 0 else None)
            raise died from (e if isinstance(e, OSError) else None)
        if kind == "done":
            return payload
        # outside the try: a store's TimeoutError or OSError is the store's failure, not the process's end
        raise _error(payload)

    def spawn(self) -> None:
        """Start the process without waiting for it (the manager's first save does this, so that the first upload does
        not wait for the process's imports); :meth:`start` then waits for it to be ready. Raises
        :class:`SenderUnavailable`."""
        if self.off is not None:
            raise SenderUnavailable(self.off)
        if self._proc is not None and self._proc.poll() is None:
            return
        if self._proc is not None:
            logger.warning("the upload process (pid %d) ended between uploads (%s); starting a new one",
                           self._proc.pid, _how(self._proc.returncode))
            if not self._killed:
                self._tell(SenderDied(f"the upload process (pid {self._proc.pid}) ended between uploads "
                                      f"({_how(self._proc.returncode)}); a new one was started"), None)
        self._reap()
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # the package as this process imported it, also when it runs from a source tree
        root = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        try:
            with theirs:
                proc = subprocess.Popen([self.python, "-m", __name__, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                        stdin=subprocess.DEVNULL, env=env)
        except OSError as e:
            ours.close()
            self.off = f"it could not be started ({self.python}: {e})"
            self._tell(SenderUnavailable(self.off), None)
            raise SenderUnavailable(self.off) from e
        conn = Connection(ours.detach())
        with self._lock:
            self._proc, self._conn, self._ready = proc, conn, False
        try:
            conn.send(("tier", self.spec))
        except OSError:
            pass  # it died at once: start() says how

    def start(self) -> Connection:
        """The process's connection, once it is ready (started now if it does not run). Raises
        :class:`SenderUnavailable`."""
        self.spawn()
        proc, conn = self._proc, self._conn
        assert proc is not None and conn is not None
        if self._ready:
            return conn
        try:
            if not conn.poll(self.ready_timeout_s):
                raise TimeoutError(f"not ready within {self.ready_timeout_s:.0f} s")
            kind, detail = conn.recv()
            if kind != "ready":
                raise CheckpointError(detail)
        except (EOFError, OSError, CheckpointError) as e:
            self._reap()
            self.off = f"it did not start ({e if str(e) else _how(proc.returncode)})"
            self._tell(SenderUnavailable(self.off), None)
            raise SenderUnavailable(self.off) from None
        self._ready = True
        logger.debug("upload process %d ready", proc.pid)
        return conn

    def _reap(self) -> int | None:
        """Forget the process (killing it if it runs); its exit code, or None."""
        with self._lock:
            proc, conn = self._proc, self._conn
            self._proc = self._conn = None
        if conn is not None:
            conn.close()
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        try:
            return proc.wait(5.0)
        except subprocess.TimeoutExpired:
            return None

    def _tell(self, e: CheckpointError, step: int | None) -> None:
        if self.on_failure is not None:
            try:
                self.on_failure(e, step)
            except Exception as err:  # reporting must not turn a failure the caller survives into one it does not
                logger.debug("reporting the upload process's failure failed: %s", err)

    def kill(self) -> None:
        """End the process now, on purpose, from any thread (the manager's exit); an upload in it fails, and the
        failure is not reported as one."""
        self._killed = True
        self._kill()

    def _kill(self) -> None:
        with self._lock:
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def close(self, timeout: float = 5.0) -> None:
        """End the process: it exits when its socket closes (and is killed after ``timeout``)."""
        with self._lock:
            proc, conn = self._proc, self._conn
            self._proc = self._conn = None
        if conn is not None:
            conn.close()
        if proc is not None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)


class ProcessTier:
    """The persistent tier for an upload's metadata calls (:data:`CALLS`): made in the upload process while it can be
    used, else on ``direct`` (the training process's own tier object), as the files are sent. ``on_unavailable`` is
    told once when the process cannot be used; a process that died is reported by :class:`SenderDied`'s warning and
    the call is made here."""

    def __init__(self, sender: SendProcess, direct: Any, on_unavailable: Callable[[SenderUnavailable], None]):
        self.sender, self.direct, self.on_unavailable = sender, direct, on_unavailable
        self.name = direct.name

    def __repr__(self) -> str:
        return f"{self.direct!r} (from the upload process)"

    def _call(self, name: str, *args: Any) -> Any:
        if self.sender.off is None:
            try:
                return self.sender.call(name, *args)
            except SenderUnavailable as e:
                self.on_unavailable(e)
            except SenderDied as e:
                logger.warning("%s; the call is made from the training process", e)
        return getattr(self.direct, name)(*args)

    def write_bytes(self, step: int, name: str, data: bytes) -> None:
        self._call("write_bytes", step, name, bytes(data))

    def delete_file(self, step: int, name: str) -> None:
        self._call("delete_file", step, name)

    def list_files(self, step: int) -> dict[str, int]:
        return self._call("list_files", step)

    def steps(self) -> dict[int, bool]:
        return self._call("steps")

    def delete_step(self, step: int) -> None:
        self._call("delete_step", step)


def _how(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _error(payload: Any) -> BaseException:
    """The exception the process sent back (pickled), or a CheckpointError with its text."""
    try:
        e = pickle.loads(payload)
        if isinstance(e, BaseException):
            return e
    except Exception:  # a store's exception class this process cannot rebuild
        pass
    return CheckpointError(f"the upload process failed: {payload!r}"[:2000])


# ------------------------------------------------------------------ the process itself
def _reply_error(e: BaseException) -> bytes:
    try:
        data = pickle.dumps(e)
        pickle.loads(data)  # some exceptions pickle but cannot be rebuilt
        return data
    except Exception:
        return pickle.dumps(CheckpointError(f"{type(e).__name__}: {e}"))


def serve(conn: Connection) -> None:
    """The process's loop: build the tier, then run each job; a reader thread takes the socket's messages, so a
    "stop" reaches the retries of the job running, and the socket's end (the training process gone) ends the process
    at once, mid-upload too (a file appears whole or not at all, and the step stays uncommitted)."""
    jobs: queue.Queue[tuple[Any, ...]] = queue.Queue()
    stop_step = [-1]
    if not conn.poll(READY_TIMEOUT_S):  # the training process sends the tier at once
        return
    kind, spec = conn.recv()
    try:
        if kind != "tier":
            raise CheckpointError(f"expected the tier first, got {kind!r}")
        if spec.nice:
            lower_thread_priority(spec.nice)  # before the sender threads start: they inherit it
        tier = spec.build()
    except Exception as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))

    sending = threading.Lock()  # the sender threads tell what landed while the main thread answers

    def tell(msg: tuple[Any, ...]) -> None:
        with sending:
            conn.send(msg)

    def read() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                os._exit(0)
            if msg[0] in ("send", "code", "call"):
                jobs.put(msg)
            elif msg[0] == "stop":
                stop_step[0] = max(stop_step[0], int(msg[1]))

    threading.Thread(target=read, name="resilient-upload-reader", daemon=True).start()
    while True:
        msg = jobs.get()
        try:
            if msg[0] == "send":
                job: SendJob = msg[1]
                out: Any = send_files(tier, job, should_stop=lambda: stop_step[0] >= job.step,
                                      on_landed=lambda name: tell(("landed", name)))
            elif msg[0] == "code":
                cjob: CodeJob = msg[1]
                out = code_files(tier, cjob, should_stop=lambda: stop_step[0] >= cjob.step,
                                 on_landed=lambda name: tell(("landed", name)))
            else:
                name, args = msg[1], msg[2]
                if name not in CALLS:
                    raise ValueError(f"not a tier call of the upload process: {name!r}")
                out = getattr(tier, name)(*args)
            tell(("done", out))
        except BaseException as e:  # every failure goes back to the upload thread, which reports it
            tell(("error", _reply_error(e)))


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    # its life is its socket's: a SIGTERM or Ctrl-C sent to the job's process group (a preemption, a restart) must not
    # end it before the training process's last upload, which the training process decides on
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format=f"[upload process {os.getpid()}] %(levelname)s %(name)s: %(message)s")
    conn = Connection(int(args[0]))
    try:
        serve(conn)
    except (EOFError, OSError):
        pass
    os._exit(0)


if __name__ == "__main__":
    main()
