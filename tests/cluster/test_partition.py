"""Never two supervisors, with a real partition rather than a kill: three agents (the host, a member, a warm spare;
one worker each) in network namespaces of their own, joined by veth pairs to a bridge. The hosting node's link is
cut: the majority's side (the member and the spare) takes the job over and finishes it bit-exact, while the host,
cut off, stops its worker and acts no more; once the link is back, it leaves the job (one line, exit 0) instead of
acting again. The agents are alive the whole time: nothing closes a connection, only silence tells."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from resilient.events.api import EventKind
from resilient.supervisor.quorum import Quorum
from .conftest import Cluster, wait_for
from .test_node_loss import GATE_STEP, STEPS, assert_same, at_gate, final, node_name
from .test_node_loss import reference  # noqa: F401 - the fixture
from .test_succession import ENV, LATE_GATE, _first_step_after, _knows

WORLD = 2  # two members of one worker each; the spare takes the host's rank
NAMES = ("host", "b", "spare")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


@pytest.fixture(scope="module")
def netns_ok() -> None:
    """Namespaces and veth pairs need root with CAP_NET_ADMIN: probed once, skipped with the reason otherwise."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2): cannot make network namespaces")
    if os.geteuid() != 0:
        pytest.skip("not root: network namespaces need CAP_NET_ADMIN")
    ns, a, br = f"rsprobe{os.getpid()}", f"rsp{os.getpid()}a", f"rspbr{os.getpid()}"
    try:
        r = _ip("netns", "add", ns, check=False)
        if r.returncode != 0:
            pytest.skip(f"`ip netns add` refused (no CAP_NET_ADMIN?): {r.stderr.strip()}")
        r = _ip("link", "add", a, "type", "veth", "peer", "name", f"rsp{os.getpid()}b", check=False)
        if r.returncode != 0:
            pytest.skip(f"`ip link add ... type veth` refused: {r.stderr.strip()}")
        r = _ip("link", "add", br, "type", "bridge", check=False)
        if r.returncode != 0:
            pytest.skip(f"`ip link add ... type bridge` refused (no bridge support?): {r.stderr.strip()}")
    finally:
        _ip("link", "del", br, check=False)
        _ip("link", "del", a, check=False)
        _ip("netns", "del", ns, check=False)


class Net:
    """A bridge in this namespace and one namespace per node, each with ``eth0`` on the bridge's subnet."""

    def __init__(self) -> None:
        tag = os.getpid() % 100000
        self.bridge = f"rsbr{tag}"
        self.subnet = f"10.213.{os.getpid() % 250}"
        self.ns = {n: f"rs{tag}{n[0]}" for n in NAMES}
        self.veth = {n: f"rs{tag}{n[0]}0" for n in NAMES}  # this namespace's end
        self.addr = {n: f"{self.subnet}.{i + 1}" for i, n in enumerate(NAMES)}

    def up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)  # for the test's own probes
        _ip("link", "set", self.bridge, "up")
        for n in NAMES:
            ns, here = self.ns[n], self.veth[n]
            _ip("netns", "add", ns)
            _ip("link", "add", here, "type", "veth", "peer", "name", f"{here}x")
            _ip("link", "set", f"{here}x", "netns", ns)
            _ip("-n", ns, "link", "set", f"{here}x", "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.addr[n]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "set", here, "master", self.bridge)
            _ip("link", "set", here, "up")

    def cut(self, n: str) -> None:
        _ip("link", "set", self.veth[n], "down")

    def heal(self, n: str) -> None:
        _ip("link", "set", self.veth[n], "up")

    def down(self) -> None:
        for n in NAMES:
            _ip("link", "del", self.veth[n], check=False)
            _ip("netns", "del", self.ns[n], check=False)
        _ip("link", "del", self.bridge, check=False)


@pytest.fixture
def net(netns_ok) -> Iterator[Net]:
    n = Net()
    try:
        n.up()
        yield n
    finally:
        n.down()


class NsCluster(Cluster):
    """The cluster helper's agents, each started in its node's namespace with its own address."""

    def __init__(self, tmp: Path, net: Net, **kw) -> None:
        super().__init__(tmp, "2", **kw)
        self.net, self._starting = net, ""

    def agent_cmd(self, local: Path, script_args: list[str], extra: list[str]) -> list[str]:
        cmd = super().agent_cmd(local, script_args, extra)
        n = self._starting
        cmd[cmd.index("--rdzv-endpoint") + 1] = f"{self.net.addr['host']}:{self.port}"
        cmd[cmd.index("--local-addr") + 1] = self.net.addr[n]
        # the host binds the endpoint; the others never try (their address is not the endpoint's)
        cmd[cmd.index("--rdzv-id"):cmd.index("--rdzv-id")] = ["--rdzv-conf", f"is_host={n == 'host'}".lower()]
        return ["ip", "netns", "exec", self.net.ns[n], *cmd]

    def start_in(self, n: str, script_args: list[str]):
        self._starting = n
        # gloo picks its interface from the host name, which names no address in these namespaces
        return self.start(n, script_args, env={**ENV, "GLOO_SOCKET_IFNAME": "eth0"})

    def listening(self) -> bool:
        with socket.socket() as s:
            s.settimeout(0.2)
            return s.connect_ex((self.net.addr["host"], self.port)) == 0


# ------------------------------------------------------------------------------------------ the count, on its own
def test_a_set_of_nodes_changes_only_once_a_majority_of_the_old_one_acknowledged_it() -> None:
    # five nodes split 2 | 3: the host's side must never account for a majority, however its losses are staggered
    q = Quorum(window=3.0, host="h")
    q.assigned(0, ["h", "m1", "m2", "s1", "s2"], now=0.0)
    for n in ("m1", "m2", "s1", "s2"):
        q.heard(n, 0.0)
    assert q.count(1.0).majority
    q.heard("m1", 4.0)  # m2, s1, s2 fell silent beyond the partition
    assert not q.count(4.0).majority
    # a new assignment of the host's side (m2 swapped out for s2 before s2 fell silent too) is not counted on its
    # own: a majority of the set it replaces must acknowledge it first
    q.assigned(1, ["h", "m1", "s2"], now=4.0)
    q.acked("m1", 1)
    assert q.nodes == ("h", "m1", "m2", "s1", "s2") and not q.count(4.0).majority
    q.acked("s2", 1)
    assert q.nodes == ("h", "m1", "s2")


def test_the_dead_are_accounted_for_the_silent_are_not() -> None:
    q = Quorum(window=3.0, host="b")
    q.reset(["h", "b", "s"])
    assert not q.count(0.0).majority  # a successor alone: the old host may live beyond a partition
    q.dead("h")  # its address refused a connection
    assert q.count(0.0).majority
    q.heard("h", 1.0)  # it answers after all: alive, and counted only while heard
    assert not q.count(5.0).majority
    q.grow(["x"])
    assert q.nodes == ("h", "b", "s", "x")
    empty = Quorum(window=3.0)
    empty.grow(["x"])  # before any assignment there is nothing to count among
    assert empty.nodes == () and empty.count(0.0).majority


def _actions(evs: list, *kinds: str) -> list:
    return [e for e in evs if e.kind == EventKind.ACTION and e.details.get("action") in kinds]


@pytest.mark.timeout(420, func_only=True)
def test_hosting_node_cut_off_majority_goes_on_old_host_leaves(net: Net, tmp_path: Path,
                                                               reference) -> None:  # noqa: F811
    node_timeout = 6.0  # silence is the only sign of a partition: this bounds its detection on both sides
    c = NsCluster(tmp_path / "c", net, flags=["--spare-nodes", "1", "--max-restarts", "3", "--node-timeout",
                                              str(node_timeout), "--heartbeat-timeout", "300",
                                              "--supervisor-timeout", "120"], nproc=1)
    c.tmp.mkdir(parents=True)
    try:
        _run(c, net, tmp_path, node_timeout, reference)
    finally:
        c.close()


def _run(c: NsCluster, net: Net, tmp_path: Path, node_timeout: float, reference: list) -> None:  # noqa: F811
    gate, out = tmp_path / "gate", tmp_path / "out"
    gate.mkdir()
    # the second gate holds the majority's job after the swap, for the heal to come while it still runs
    args = ["--steps", str(STEPS), "--out", str(out), "--gate", str(gate), "--gate-step", str(GATE_STEP),
            str(LATE_GATE)]
    host = c.start_in("host", args)
    wait_for(lambda: c.listening() or host.proc.poll() is not None, 60, "the host to bind the endpoint")
    b = c.start_in("b", args)
    wait_for(lambda: len({e.node for e in c.events() if e.kind == EventKind.ATTEMPT_START}) == 2
             or host.proc.poll() is not None or b.proc.poll() is not None, 90, "both members' workers to start")
    spare = c.start_in("spare", args)
    wait_for(lambda: at_gate(gate, WORLD), 90, "both ranks at the gate")
    wait_for(lambda: any(e.kind == EventKind.NODE_JOINED and e.node == node_name(spare) for e in c.events())
             or spare.proc.poll() is not None, 150, "the spare to join")
    # b takes over (first in the order), the spare follows it there: both must know the order before the cut
    wait_for(lambda: _knows(b, node_name(b), node_name(spare)) and _knows(spare, node_name(b)), 30,
             "b and the spare to read a succession naming both")

    t_cut = time.time()
    net.cut("host")
    wait_for(lambda: _actions(c.events(), "hot_swap") or b.proc.poll() is not None, 90,
             "the majority's side to swap the spare in for the host")
    t_swap = _actions(c.events(), "hot_swap")[0].wall
    # the host, alone, stood down and stopped its worker before the gate opens (its rank would go on otherwise)
    wait_for(lambda: "stopping its workers" in host.text() or host.proc.poll() is not None, 60,
             "the cut-off host to stop its worker")
    assert host.proc.poll() is None, host.output()
    (gate / "go").touch()
    wait_for(lambda: at_gate(gate, WORLD, f"-{LATE_GATE}") or b.proc.poll() is not None, 120,
             "the majority's job to train on after the swap")

    t_heal = time.time()
    net.heal("host")
    wait_for(lambda: host.proc.poll() is not None, 60, "the old host to leave once it sees the successor")
    t_left = time.time()
    assert host.proc.returncode == 0, host.output()
    assert "cut off from the majority" in host.text() and "leaving the job" in host.text(), host.output()

    (gate / f"go-{LATE_GATE}").touch()
    wait_for(lambda: b.proc.poll() is not None and spare.proc.poll() is not None, 180, "the job to end")
    assert b.proc.returncode == 0, b.output()
    assert spare.proc.returncode == 0, spare.output()
    evs = c.events()
    taken = [e for e in evs if e.kind == EventKind.LOG and "succession" in e.details]
    assert len(taken) == 1 and taken[0].details["succession"]["from"] == node_name(host), taken
    assert taken[0].details["succession"]["to"] == node_name(b)
    # one swap, the successor's; the old host's own decisions (it found b and the spare silent) were never
    # carried out, before the heal or after it
    swaps = _actions(evs, "hot_swap")
    assert len(swaps) == 1, [e.details for e in evs if e.kind == EventKind.ACTION]
    assert swaps[0].details["action_args"] == {**swaps[0].details["action_args"], "node": node_name(host),
                                               "spare": node_name(spare)}
    assert not _actions(evs, "restart", "stop", "scale_down", "scale_up"), \
        [e.details for e in evs if e.kind == EventKind.ACTION]
    stood = [e for e in evs if e.kind == EventKind.LOG and e.details.get("quorum", {}).get("stood_down")]
    assert len(stood) == 1 and stood[0].wall > t_cut, stood
    # the host's worker was stopped while cut off: its attempt ended, and no step of its rank came after the cut
    assert [e for e in evs if e.kind == EventKind.ATTEMPT_END and e.node == node_name(host) and e.wall > t_cut]
    assert not [e for e in evs if e.kind == EventKind.STEP and e.node == node_name(host) and e.wall > t_cut]
    assert_same(reference, final(out, WORLD))
    spare_start = next(e for e in evs if e.kind == EventKind.ATTEMPT_START and e.node == node_name(spare))
    first = _first_step_after(evs, spare_start.attempt if spare_start.attempt is not None
                              else spare_start.details["attempt"])
    assert first is not None
    print(f"\ncut -> successor's swap: {t_swap - t_cut:.2f} s; cut -> first step after (gate held until the host "
          f"stopped its worker): {first - t_cut:.2f} s; heal -> old host left: {t_left - t_heal:.2f} s "
          f"(--node-timeout {node_timeout:g})")
    wait_for(lambda: not c.leftovers(), 20, "no process of the job left")
