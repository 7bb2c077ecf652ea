"""Wire format of the worker → agent datagrams.

Each worker process holds one connected Unix ``SOCK_SEQPACKET`` socket to the agent and sends one packet
per message, non-blocking, never waiting for a reply: a send that would block is dropped instead. Sequenced
packets keep message boundaries like datagrams, but queue up to the socket buffer per connection (a
datagram socket queues only ``net.unix.max_dgram_qlen`` = 10 packets for all senders together), and the
agent learns each sender's pid from the kernel (``SO_PEERCRED``) and sees a dead worker's connection close.
Every message starts with the same fixed header; the body is fixed-size binary, except the section name,
which is UTF-8 after it. Any message counts as a heartbeat.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

PROTOCOL_VERSION = 1

HELLO = 1  # steps() started: body world_size, local_world_size, start step
STEP = 2  # a step starts: body step, previous step's wall seconds and own-work seconds (NaN if none)
SECTION_START = 3  # body timeout (NaN: learned), then name
SECTION_END = 4  # body seconds, then name
DONE = 5  # steps() finished or left: body last step

# type, version, local rank, global rank, pid, attempt (-1 when unknown)
HEADER = struct.Struct("<BBHiii")
_HELLO = struct.Struct("<iiq")
_STEP = struct.Struct("<qdd")
_SECTION = struct.Struct("<d")
_DONE = struct.Struct("<q")
MAX_PACKET = 512
_NAME_MAX = MAX_PACKET - HEADER.size - _SECTION.size


def socket_address(path: str) -> str | bytes:
    """``@name`` is a Linux abstract-namespace socket (no file, unreachable from the network)."""
    if path.startswith("@"):
        return b"\0" + path[1:].encode()
    return path


@dataclass(frozen=True)
class Message:
    type: int
    local_rank: int
    rank: int
    pid: int
    attempt: int
    step: int = -1
    seconds: float = math.nan  # STEP: previous step's wall time; SECTION_END: section wall time
    compute: float = math.nan  # STEP: previous step's own work (wall time minus collective waits and CPU waits)
    timeout: float | None = None  # SECTION_START
    name: str = ""
    world_size: int = 0
    local_world_size: int = 0


def header(type_: int, local_rank: int, rank: int, pid: int, attempt: int) -> bytes:
    return HEADER.pack(type_, PROTOCOL_VERSION, local_rank & 0xFFFF, rank, pid, attempt)


def pack_hello(hdr: bytes, world_size: int, local_world_size: int, step: int) -> bytes:
    return hdr + _HELLO.pack(world_size, local_world_size, step)


def pack_step(hdr: bytes, step: int, seconds: float, compute: float) -> bytes:
    return hdr + _STEP.pack(step, seconds, compute)


def pack_section_start(hdr: bytes, name: str, timeout: float | None) -> bytes:
    return hdr + _SECTION.pack(math.nan if timeout is None else timeout) + name.encode()[:_NAME_MAX]


def pack_section_end(hdr: bytes, name: str, seconds: float) -> bytes:
    return hdr + _SECTION.pack(seconds) + name.encode()[:_NAME_MAX]


def pack_done(hdr: bytes, step: int) -> bytes:
    return hdr + _DONE.pack(step)


def with_type(hdr: bytes, type_: int) -> bytes:
    return bytes([type_]) + hdr[1:]


def unpack(data: bytes) -> Message | None:
    """Decode one datagram; None for anything malformed or from another protocol version."""
    if len(data) < HEADER.size:
        return None
    type_, version, local_rank, rank, pid, attempt = HEADER.unpack_from(data)
    if version != PROTOCOL_VERSION:
        return None
    off = HEADER.size
    base = dict(type=type_, local_rank=local_rank, rank=rank, pid=pid, attempt=attempt)
    try:
        if type_ == HELLO:
            ws, lws, step = _HELLO.unpack_from(data, off)
            return Message(**base, world_size=ws, local_world_size=lws, step=step)
        if type_ == STEP:
            step, secs, comp = _STEP.unpack_from(data, off)
            return Message(**base, step=step, seconds=secs, compute=comp)
        if type_ in (SECTION_START, SECTION_END):
            (val,) = _SECTION.unpack_from(data, off)
            name = data[off + _SECTION.size:].decode(errors="replace")
            if type_ == SECTION_START:
                return Message(**base, name=name, timeout=None if math.isnan(val) else val)
            return Message(**base, name=name, seconds=val)
        if type_ == DONE:
            (step,) = _DONE.unpack_from(data, off)
            return Message(**base, step=step)
    except struct.error:
        return None
    return None
