"""Automatic preload, in two parts. Before the first spawn: a static read (``ast``, nothing executed) of the entry
script's and its local modules' top-level imports names the installed packages it will import, and the first fork
server imports them once instead of every worker (:func:`entry_imports`); one that makes forking unsafe is left out
(the server starts again without it) and denied from then on; the costly defaults (``torch._dynamo``, DCP, our
checkpointer) only when the program's code names what needs them (:func:`soft_needed`). After the first attempt, a fork server that has
already imported what the workers imported replaces the current one at the next restart (a spare's at once), so
heavy scripts restart as fast as with a hand-written ``--preload``; this learns what the static read misses
(imports made by name, inside functions, or beyond the bound on files read).

The warmed fork server is a copy of the running one (forked: torch and the rest come for free) that then imports
only the learned modules, and more as the workers report them; it takes over only once it has imported all it was
given: training and restarts never wait for it. A learned module that makes forking unsafe is remembered in the
run directory and never preloaded again.
"""

from __future__ import annotations

import ast
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from resilient.launcher.api import AgentConfig, WorkerCommand, WorkerLaunchMethod
from resilient.launcher.starters import ForkServer, ForkServerError, SpawnStarter, WorkerStarter

logger = logging.getLogger(__name__)


#: soft defaults that cost seconds of CPU to import, and the names whose presence in a program's code (a name, an
#: attribute, an imported module or name) says its workers will import them. A program read whole (see
#: :func:`soft_needed`) with none of them starts from a fork server without that module; a worker that imports it
#: anyway teaches it to the next fork server, as any module.
SOFT_EVIDENCE: dict[str, frozenset[str]] = {
    # an optimizer's first step, DistributedDataParallel's construction, FSDP2's fully_shard and torch.compile each
    # import it (as much CPU as torch itself)
    "torch._dynamo": frozenset({"optim", "DistributedDataParallel", "DDP", "fully_shard", "FullyShardedDataParallel",
                                "FSDP", "compile", "_dynamo", "dynamo", "ddp", "make_exact"}),
    "torch.distributed.checkpoint": frozenset({"checkpoint", "CheckpointManager", "dcp"}),
    "resilient.checkpoint.save.manager": frozenset({"checkpoint", "CheckpointManager"}),
}
#: packages whose use says nothing of the soft defaults by itself; any other installed package (a training
#: framework) may import all of them
NEUTRAL_PACKAGES = frozenset({"torch", "resilient", "numpy"})


def _package(entry: str) -> str:
    """The top-level package of an :func:`entry_imports` entry (``module`` or ``module:name``)."""
    return entry.split(":", 1)[0].split(".", 1)[0]


def soft_needed(found: tuple[str, ...], names: frozenset[str], complete: bool) -> frozenset[str] | None:
    """The soft defaults a program's workers will import, from the static read: None (all of them) unless the read
    was complete and names only the standard library, torch, numpy and resilient; then those of
    :data:`SOFT_EVIDENCE` whose names appear in its code."""
    if not complete:
        return None
    if any(_package(e) not in sys.stdlib_module_names and _package(e) not in NEUTRAL_PACKAGES for e in found):
        return None
    return frozenset(m for m, why in SOFT_EVIDENCE.items() if why & names)


def preload_modules(cfg: AgentConfig, soft_only: frozenset[str] | None = None) -> tuple[str, ...]:
    """What the fork server imports ahead of time: what every resilient worker imports anyway
    (soft: a failure only costs speed), then the user's ``--preload`` modules (hard). ``soft_only``: of the
    costly soft defaults (:data:`SOFT_EVIDENCE`), only these (None: all)."""
    # DistributedDataParallel imports torch._dynamo on construction: seconds per restart otherwise
    soft = ["torch._dynamo", "torch.distributed.checkpoint", "torch.nn.parallel", "resilient.checkpoint.save.manager",
            "resilient.worker.steps"]
    if soft_only is not None:
        soft = [m for m in soft if m not in SOFT_EVIDENCE or m in soft_only]
    if (cfg.ckpt_persistent or "").startswith("gs://"):
        if os.environ.get("STORAGE_EMULATOR_HOST"):
            # gcsfs reads this at import, and the fork server imports it before a worker could set it;
            # against an emulator its bucket-type probe otherwise waits a minute per call
            os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        soft.append("gcsfs")
    return tuple(f"?{m}" for m in soft) + tuple(cfg.preload)


#: the fork server's preload item for a program that imports only the standard library: it skips torch and our
#: defaults (see resilient.launcher.zygote.preload)
NO_TORCH = "~torch"
ENTRY_MAX_FILES = 64  # local files read to find the entry script's imports (a large repository stops here)
ENTRY_MAX_BYTES = 2 << 20  # a larger "module" is data, not code worth parsing at start-up


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: the module's body and the branches of its ``if``/``try``/
    ``with`` statements, never a function's or class's body (a ``try``'s handlers are fallbacks: skipped)."""
    out: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        st = todo.pop(0)
        if isinstance(st, (ast.Import, ast.ImportFrom)):
            out.append(st)
        elif isinstance(st, ast.If):
            test = st.test.attr if isinstance(st.test, ast.Attribute) else getattr(st.test, "id", None)
            # ``if TYPE_CHECKING:`` imports never run
            todo[:0] = [*st.body, *st.orelse] if test != "TYPE_CHECKING" else list(st.orelse)
        elif isinstance(st, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            todo[:0] = [*st.body, *st.orelse]
        elif isinstance(st, (ast.With, ast.AsyncWith)):
            todo[:0] = list(st.body)
    return out


def _local_file(dotted: str, roots: list[str]) -> tuple[str | None, bool]:
    """The file of module ``dotted`` under one of ``roots`` (its ``__init__.py`` for a package), and whether its
    top-level package is local at all (a local package without that submodule file is still local)."""
    parts = dotted.split(".")
    for root in roots:
        base = os.path.join(root, *parts)
        top = os.path.join(root, parts[0])
        if not (os.path.isdir(top) or os.path.isfile(top + ".py")):
            continue
        for f in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(f):
                return f, True
        return None, True
    return None, False


def entry_imports(cmd: WorkerCommand, cwd: str, max_files: int = ENTRY_MAX_FILES) -> tuple[str, ...]:
    """What the worker's program imports from outside its own code, read statically: ``module`` or
    ``module:name`` (a ``from module import name``: packages such as transformers load their classes lazily,
    on that attribute) entries, in the order first seen. Local modules (next to the script, or in the working
    directory) are read in turn, up to ``max_files``; they are never imported themselves. A file that cannot be
    read or parsed is skipped (logged at debug): this only speeds start-up up."""
    return _entry_scan(cmd, cwd, max_files)[0]


def _names(tree: ast.Module) -> set[str]:
    """Every identifier the code uses: names, attributes, and the parts of what it imports."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.alias):
            out.update(node.name.split("."))
            if node.asname:
                out.add(node.asname)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.update(node.module.split("."))
    return out


def _entry_scan(cmd: WorkerCommand, cwd: str, max_files: int = ENTRY_MAX_FILES,
                idents: set[str] | None = None) -> tuple[tuple[str, ...], bool]:
    """:func:`entry_imports`, and whether the read was complete (every local file read, none skipped); with
    ``idents``, every identifier of the files read is added to it."""
    complete = True
    if cmd.kind == "script":
        entry = cmd.target if os.path.isabs(cmd.target) else os.path.join(cwd, cmd.target)
        roots = [os.path.dirname(os.path.abspath(entry)), cwd]
    elif cmd.kind == "module":
        roots = [cwd]
        entry, _ = _local_file(cmd.target, roots)
        if entry is None:
            return (), False
    else:
        return (), False
    roots = list(dict.fromkeys(os.path.realpath(r) for r in roots))
    seen_files: set[str] = set()
    todo = [entry]
    found: dict[str, None] = {}
    while todo and len(seen_files) < max_files:
        path = os.path.realpath(todo.pop(0))
        if path in seen_files:
            continue
        seen_files.add(path)
        try:
            if os.path.getsize(path) > ENTRY_MAX_BYTES:
                complete = False
                continue
            with open(path, "rb") as f:
                tree = ast.parse(f.read(), filename=path)
        except (OSError, SyntaxError, ValueError, RecursionError, MemoryError) as e:
            logger.debug("entry imports: cannot read %s (%s); its imports are learned from the workers", path, e)
            complete = False
            continue
        if idents is not None:
            idents |= _names(tree)
        pkg_dir = os.path.dirname(path)
        for node in _top_level_imports(tree):
            if isinstance(node, ast.Import):
                targets = [(a.name, ()) for a in node.names]
            elif node.level:  # relative: only ever the user's own package
                base = pkg_dir
                for _ in range(node.level - 1):
                    base = os.path.dirname(base)
                rel = os.path.join(base, *(node.module or "").split(".")) if node.module else base
                for f in (rel + ".py", os.path.join(rel, "__init__.py"),
                          *(os.path.join(rel, f"{a.name}.py") for a in node.names),
                          *(os.path.join(rel, a.name, "__init__.py") for a in node.names)):
                    if os.path.isfile(f):
                        todo.append(f)
                continue
            else:
                targets = [(node.module or "", tuple(a.name for a in node.names if a.name != "*"))]
            for mod, names in targets:
                if not mod or mod == "__future__":
                    continue
                f, local = _local_file(mod, roots)
                if local:
                    if f is not None:
                        todo.append(f)
                    for n in names:  # ``from pkg import submodule``
                        sub, _ = _local_file(f"{mod}.{n}", roots)
                        if sub is not None:
                            todo.append(sub)
                    continue
                found.setdefault(mod)
                for n in names:
                    found.setdefault(f"{mod}:{n}")
    if todo:
        logger.debug("entry imports: stopped after %d local files", len(seen_files))
    return tuple(found), complete and not todo


def stdlib_only(found: tuple[str, ...], complete: bool) -> bool:
    """A program read whole whose every import is of the standard library: it never needs torch (a dynamic import
    of it is learned from the workers for the next restart, as any other module)."""
    return complete and all(_package(e) in sys.stdlib_module_names for e in found)


def _static_entries(cfg: AgentConfig, run_dir: Path,
                    denied: set[str]) -> tuple[tuple[str, ...], frozenset[str] | None]:
    """``=entry`` items for the first fork server: the entry script's imports, less the denied ones; with
    :data:`NO_TORCH` first when the program imports nothing beyond the standard library (nothing to warm: its
    workers start from a server that skipped torch, seconds of CPU sooner). And the costly soft defaults its
    workers need (:func:`soft_needed`; None: all)."""
    names: set[str] = set()
    try:
        found, complete = _entry_scan(cfg.command, os.getcwd(), idents=names)
    except Exception as e:  # noqa: BLE001 - a speed-up only: never a reason for the launch to fail
        logger.debug("entry imports: not read (%s)", e)
        return (), None
    if stdlib_only(found, complete) and not cfg.preload:
        logger.debug("entry imports: the standard library only; the fork server skips torch")
        return (NO_TORCH,), None
    soft = soft_needed(found, frozenset(names), complete)
    if soft is not None and len(soft) < len(SOFT_EVIDENCE):
        logger.debug("entry imports: nothing in the program uses %s; the fork server skips it",
                     ", ".join(sorted(set(SOFT_EVIDENCE) - soft)))
    keep = tuple(e for e in found if _package(e) not in denied and e.split(":", 1)[0] not in denied)
    if keep:
        logger.info("preloading %d imports of the entry script in the fork server (%s%s)", len(keep),
                    ", ".join(keep[:5]), ", ..." if len(keep) > 5 else "")
    return tuple(f"={e}" for e in keep), soft


def _import_torch_unthreaded() -> None:
    """Import torch in the agent (its store needs it anyway) before any thread of the agent's starts: the fork
    server is then forked with it (ForkServer(inherit=True)) and a node start imports torch once instead of twice.
    numpy's OpenBLAS, which torch imports, would start a thread pool (forking a threaded process is unsafe), so it
    is told to keep one thread, as an exec'd server's is; the variable is taken back at once, so the workers'
    environment stays the user's."""
    had = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import torch.distributed  # noqa: F401
    finally:
        if had is None:
            del os.environ["OPENBLAS_NUM_THREADS"]
        else:
            os.environ["OPENBLAS_NUM_THREADS"] = had


def new_fork_server(cfg: AgentConfig, run_dir: Path, learned: tuple[str, ...],
                    static: tuple[str, ...] = (), soft_only: frozenset[str] | None = None) -> ForkServer:
    d = run_dir / "preload"
    if learned or static:
        d.mkdir(parents=True, exist_ok=True)
    defaults = () if NO_TORCH in static else preload_modules(cfg, soft_only)
    if defaults and "torch" not in sys.modules:
        _import_torch_unthreaded()
    return ForkServer(defaults + static + tuple(f"+{m}" for m in learned), tag=f"run={run_dir.resolve()}",
                      preload_file=str(d / f"modules-{os.getpid()}.txt"), inherit=True)


def first_starter(cfg: AgentConfig, run_dir: Path) -> WorkerStarter:
    """The fork server (started now, so that importing torch overlaps the rendezvous), or fresh interpreters."""
    if cfg.command.kind == "exec" or cfg.launch_method == WorkerLaunchMethod.SPAWN:
        return SpawnStarter()
    try:
        static, soft = _static_entries(cfg, run_dir, _read_denied(run_dir))
        return new_fork_server(cfg, run_dir, (), static, soft)
    except OSError as e:
        logger.warning("fork server unavailable (%s); starting workers as fresh interpreters", e)
        return SpawnStarter()


def _read_denied(run_dir: Path) -> set[str]:
    try:
        return set((run_dir / "preload" / "denied.txt").read_text().split())
    except OSError:
        return set()


class Preloader:
    """The fork server being warmed with learned modules, and what was learned. The group's starter is only
    replaced through ``use`` (the group is its one writer)."""

    QUIET = 0.5  # seconds without a new module before the list is taken as settled
    REFRESHES = 4  # fork servers warmed per agent for learned modules: imports cost CPU

    def __init__(self, cfg: AgentConfig, run_dir: Path) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.enabled = cfg.launch_method == WorkerLaunchMethod.FORK_SERVER and cfg.command.kind != "exec"
        self._learned: list[str] = []
        self._learned_set: set[str] = set()
        self._learned_at = 0.0
        self._preloaded: tuple[str, ...] = ()
        self.next: ForkServer | None = None  # the fork server being warmed
        self._next_preload: tuple[str, ...] = ()
        self._next_set: set[str] = set()
        self._next_asked = 0.0
        self._refreshes = 0
        self._ready_said = False
        self._polled = 0.0
        self._denied = self._load_denied()

    def _add(self, names: list[str], at: float) -> None:
        new = [m for m in names if m not in self._learned_set]
        if new:
            self._learned += new
            self._learned_set.update(new)
            self._learned_at = at

    def learn(self, starter: WorkerStarter | None) -> None:
        """Collect the modules workers reported loading (through the fork server)."""
        if starter is not None:
            self._add(starter.take_learned(), time.monotonic())
            # entry-script imports the first fork server found unsafe (and left out, restarting without them)
            bad = [m for m in getattr(starter, "static_denied", ()) if m not in self._denied]
            if bad:
                self._denied.update(bad)
                self._save_denied()
                logger.warning("automatic preload: importing %s in the fork server %s; never preloaded again",
                               ", ".join(bad), getattr(starter, "static_denied_why", "made forking unsafe"))

    def refresh(self, group: object, active: bool, fetch: Callable[[], list[str]],
                publish: Callable[[tuple[str, ...]], None]) -> None:
        """One pass: learn, warm a fork server with what was learned, and let a warm one take over while no
        worker lives. ``fetch``/``publish`` share the learned list between nodes (a spare learns from the active)."""
        if not self.enabled:
            return
        self.learn(group.starter)  # type: ignore[attr-defined]
        now = time.monotonic()
        if not active and now - self._polled > 1.0:
            self._polled = now
            # settled already on the node that sent it
            self._add(fetch(), time.monotonic() - self.QUIET)
        want = tuple(m for m in self._learned if m not in self._denied)
        settled = now - self._learned_at >= self.QUIET
        nxt = self.next
        if nxt is not None:
            try:
                extra = [m for m in want if m not in self._next_set]
                if extra and settled:  # it is idle: it imports them too, before it takes over
                    nxt.preload_more(extra)
                    self._next_preload += tuple(extra)
                    self._next_set.update(extra)
                    self._ready_said = False
                    if active:
                        publish(self._next_preload)
                warm = nxt.poll_ready()
            except (ForkServerError, OSError) as e:  # OSError: a copy refused at birth may reset its socket
                self.next = None
                nxt.close()
                if isinstance(e, ForkServerError) and e.bad_module:
                    self._denied.add(e.bad_module)
                    self._save_denied()
                    logger.warning("automatic preload: %s; %s is never preloaded again", e, e.bad_module)
                else:
                    logger.warning("automatic preload failed (%s); restarts import as before", e)
                    self._refreshes = self.REFRESHES
                return
            if warm and not self._ready_said:
                self._ready_said = True
                logger.info("automatic preload: fork server ready with %d learned modules (warm %.2fs after it was "
                            "asked); it takes over at the next restart", len(self._next_preload),
                            now - self._next_asked)
            if warm and not group.any_alive():  # type: ignore[attr-defined]
                self.swap(group)
            return
        have = set(self._preloaded)
        if not want or all(m in have for m in want) or not settled or self._refreshes >= self.REFRESHES:
            return
        self._refreshes += 1
        try:
            nxt = group.starter.ready_copy()  # type: ignore[attr-defined]
            if nxt is not None:  # a copy: only the modules it lacks cost time
                nxt.preload_more([m for m in want if m not in have])
                how = "a copy of the running one"
            else:
                nxt = new_fork_server(self.cfg, self.run_dir, want)
                how = "a new one"
        except (OSError, ForkServerError) as e:
            logger.warning("automatic preload: cannot start a fork server (%s)", e)
            self._refreshes = self.REFRESHES
            return
        self.next = nxt
        self._next_preload = want
        self._next_set = set(want)
        self._next_asked = now
        self._ready_said = False
        new = [m for m in want if m not in have]
        logger.info("automatic preload: warming a fork server (%s) with %d modules the workers loaded (%s%s)", how,
                    len(new), ", ".join(new[:5]), ", ..." if len(new) > 5 else "")
        if active:
            publish(want)

    def swap(self, group: object) -> None:
        """Between attempts (no live worker): the warmed fork server takes over."""
        nxt = self.next
        try:
            if nxt is None or not nxt.poll_ready():
                return
        except (ForkServerError, OSError):
            return  # refresh says why and forgets it
        self.next = None
        old = group.starter  # type: ignore[attr-defined]
        if old is not None:
            self.learn(old)
        group.use(nxt)  # type: ignore[attr-defined]
        if old is not None:
            if nxt.origin is old:
                nxt.adopt(old)  # the copy dies with the server it was forked from: that one stays, idle
            else:
                old.close()
        self._preloaded = self._next_preload
        logger.info("automatic preload: fork server with %d learned modules in use", len(self._preloaded))

    def _save_denied(self) -> None:
        try:
            d = self.run_dir / "preload"
            d.mkdir(parents=True, exist_ok=True)
            # written whole, then renamed: every node may share the run directory, and another agent reading a
            # truncated list would preload a module that starts threads into its fork server
            fd, tmp = tempfile.mkstemp(prefix=".denied.", suffix=".tmp", dir=d)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write("".join(f"{m}\n" for m in sorted(self._denied)))
                os.replace(tmp, d / "denied.txt")
            except OSError:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as e:
            logger.debug("cannot remember denied preloads: %s", e)

    def _load_denied(self) -> set[str]:
        return _read_denied(self.run_dir)

    def close(self) -> None:
        if self.next is not None:
            self.next.close()
