"""Point-to-point between stages on the same machine, through shared memory.

Longer than the project's ~400-line habit on purpose: one transport whose records, slots,
acknowledgements and inline messages form one protocol, checked by reading it whole.

[Note: same-host point-to-point] Under gloo, a message between two processes on one machine goes
through TCP on loopback, with gloo's I/O thread woken on both ends; on a pipeline that shares its
cores with its compute, that is most of what separates a step from the ideal
(`benchmarks/p2p_latency.py`; numbers in docs/performance.md). Stages on one machine therefore
exchange tensors through shared memory, as NCCL's SHM transport does:

- each pair of stages holds two connected `SOCK_SEQPACKET` Unix sockets (abstract namespace, so
  nothing is left in the filesystem), which carry small records in order: one for data, one for
  acknowledgements;
- a tensor of at most `INLINE` bytes travels inside its record (see [Note: small tensors
  inline]);
- a larger one: a sender copies the tensor into a *slot* it owns (a `memfd` mapping, passed to
  the peer once, with the record that first uses it, by `SCM_RIGHTS`) and sends a DATA record
  naming the slot;
- the receiver copies the tensor out when it needs it and gives the slot back with an ACK record
  on the other socket: `ACK_BATCH` slots per record, or all it holds when it is about to wait. A
  rank sleeps only on the data socket and takes ACKs back only when it has no free slot or is
  about to wait, so an ACK never wakes anyone: on a virtual machine a wake-up across cores is
  what costs most.

[Note: small tensors inline] A small tensor (an activation of 16 KiB, say) goes through the data
socket itself, in one record after its header: the sender's one system call copies it in, the
receiver's one copies it straight into the tensor it returns. No slot, no copy into shared memory
and none out, no acknowledgement. The receiver learns a record's size from its header, and reads
the next record straight into the tensor of the receive it is waiting for; only a record read
ahead of its receive (one whose shape it does not yet know) is peeked at first. The limit is agreed
per pair (a record must fit the socket's send buffer). Receives read into empty tensors allocated
`SPARES` at a time: one allocation right after a compute costs more than the send saves.

This transport keeps the relaxed model of [Note: eager point-to-point] exactly:

- a send never blocks. When every slot for that peer is in use a new one is made, so a pool grows
  to the most messages ever in flight. A record the socket cannot take now goes to a backlog that
  a background thread sends as the peer reads, so it arrives even if this stage's own thread is
  computing or blocked in a collective, as a gloo send would;
- messages between two stages arrive in the order they were sent, and the receiver numbers its
  receives per peer in program order, so each pairs with the send the compiler matched it with;
- a receive waits only when its consumer needs it.

[Note: waiting without sleeping] A receive whose data has not arrived checks again for up to
`SPIN` seconds, calling `sched_yield` between checks, before it sleeps in `poll`. A rank that owns
its core loses nothing by this (the core has nothing else to run), and a rank that shares one
hands it to whoever else is runnable at each check; a sleep and a wake-up across cores is slow on
a virtual machine (docs/performance.md measures it).

A peer that dies closes its socket: a rank waiting on it reads end-of-file at once and raises
`ConnectionError`; a wait longer than the timeout raises `TimeoutError`. Only stages whose
processes share a kernel and a network namespace are linked (the abstract socket names must
reach); any other pair stays on gloo.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import functools
import math
import mmap
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Iterable

import torch
import torch.distributed as dist

__all__ = ["PeerAborted", "ShmLinks", "host_key"]


class PeerAborted(ConnectionError):
    """The peer stage failed and said why (its one-line reason is the message)."""


class _Header:
    """A header record read ahead of its message (int64 words)."""

    __slots__ = ("words",)

    def __init__(self, words: torch.Tensor):
        self.words = words


_RECORD = struct.Struct("<BxxxIQ")  # kind, slot, bytes (DATA: the tensor's; NEW: the slot's)
_HELLO, _DATA, _NEW, _ACK, _INLINE = 0, 1, 2, 3, 4  # NEW: a slot, its fd with it; INLINE: the
# tensor follows in the record (slot unused); HELLO: who connects
_HEADER, _ABORT = 5, 6  # a message header (int64 words) follows; the peer failed (its reason)
#: The largest tensor (bytes) sent inside its record rather than through a slot; see [Note: small
#: tensors inline]. A pair whose sockets take smaller records agrees on less.
INLINE = 64 * 1024
#: Empty tensors a link keeps for the inline ones it receives, by shape, allocated a few at once
#: and topped up whenever the rank is about to wait: right after a compute one `torch.empty` took
#: 13-15 us here (caches cold), the next ones a fraction of that.
SPARES = 8
#: Seconds a receive checks for its data (yielding the core to any other runnable thread between
#: checks) before it sleeps; see [Note: waiting without sleeping].
SPIN = 0.002
#: Slots a receiver is done with before it acknowledges them (in one record); it also
#: acknowledges whenever it is about to wait. Fewer records mean fewer system calls; the sender's
#: pool grows by at most this many slots.
ACK_BATCH = 4
_ACK_RECORD = struct.Struct("<BxxxI")  # kind, count; then `count` uint32 slot numbers
_FDS = socket.CMSG_LEN(array.array("i", [0]).itemsize) if hasattr(socket, "CMSG_LEN") else 0


def host_key() -> str | None:
    """Who can reach this process's abstract Unix sockets: its kernel boot and network namespace.

    None where shared-memory links cannot be made (not Linux, or no memfd).
    """
    if not (hasattr(os, "memfd_create") and hasattr(socket, "SOCK_SEQPACKET") and _FDS):
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return None
    return f"{boot}/{netns}"


class _Channel:
    """One socket to a peer. A record the socket cannot take now goes to a backlog that a
    background thread sends, in order, as the peer reads: the sender never waits, and what it
    sent arrives without its thread doing anything more (as gloo's own I/O thread would do)."""

    __slots__ = ("backlog", "error", "lock", "sock", "thread")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.backlog: deque[tuple[bytes, int | None]] = deque()
        self.lock = threading.Lock()
        self.error: OSError | None = None
        self.thread: threading.Thread | None = None

    def send(self, record: bytes, fd: int | None = None, payload=None) -> None:
        """Send `record`, then `payload` (a buffer) in the same record, with `fd` (passed to the
        peer), now or after the backlog; never waits."""
        if self.error is not None:
            raise self.error
        # No drain thread means no backlog (only this thread queues, and the drain thread ends
        # only once the backlog is empty): send now, with no lock to take.
        if self.thread is None:
            try:
                _send(self.sock, record, fd, socket.MSG_DONTWAIT, payload)
                return
            except BlockingIOError:
                pass
        if payload is not None:  # a copy: the tensor is the caller's again once this returns
            record += bytes(payload)
        with self.lock:  # the socket is full or a backlog is draining: queue behind it
            self.backlog.append((record, fd))
            if self.thread is None:
                self.thread = threading.Thread(target=self._drain, name="schedcc-shm", daemon=True)
                self.thread.start()

    def _drain(self) -> None:
        """The background thread: send the backlog in order, waiting on the socket as needed.

        A record leaves the backlog only once sent, so `send` queues behind it meanwhile."""
        while True:
            with self.lock:
                if not self.backlog:
                    self.thread = None
                    return
                record, fd = self.backlog[0]
            try:
                _send(self.sock, record, fd, 0)
            except OSError as exc:  # the peer is gone: the next `send` (or read) says so
                self.error = exc
                with self.lock:
                    self.thread = None
                return
            with self.lock:
                self.backlog.popleft()


class _Link:
    """The connection to one peer stage: our slots, theirs, and the two channels."""

    __slots__ = (
        "acks",
        "arrived",
        "data",
        "fds",
        "free",
        "head",
        "in_views",
        "inline",
        "out_views",
        "overflow",
        "peer",
        "read",
        "slots",
        "spares",
        "theirs",
        "unacked",
    )

    def __init__(self, peer: int, data: socket.socket, acks: socket.socket, inline: int):
        self.peer = peer
        self.inline = inline  # the largest tensor sent in its record, both ways (bytes)
        self.head = bytearray(_RECORD.size)  # where each record's header is read
        # where a message header lands when it comes in place of an expected tensor
        self.overflow = bytearray(inline + 8)
        # (shape, dtype) -> empty tensors (with the buffers to read into them) for inline ones
        self.spares: dict[tuple, list[tuple[torch.Tensor, list]]] = {}
        self.data = _Channel(data)  # DATA and NEW records, both ways; a waiting rank sleeps here
        self.acks = _Channel(acks)  # ACK records, both ways; read only without waiting
        self.slots: list[torch.Tensor] = []  # ours, as uint8 tensors over the mapping
        self.free: list[int] = []  # our slots the peer has given back
        self.theirs: dict[int, torch.Tensor] = {}  # the peer's slots it has sent to us
        # message number -> (slot, bytes), or the tensor itself if it came inline (as a flat
        # uint8 tensor if read before its receive said its shape)
        self.arrived: dict[int, tuple[int, int] | torch.Tensor] = {}
        self.read = 0  # DATA records read so far (the next one's message number)
        self.fds: deque[int] = deque()  # received fds not yet mapped, in order
        self.unacked: list[int] = []  # the peer's slots we are done with, not yet acknowledged
        # typed views of a slot, by (slot, shape, dtype): one torch call per copy, not four
        self.out_views: dict[tuple, torch.Tensor] = {}
        self.in_views: dict[tuple, torch.Tensor] = {}

    def channels(self) -> tuple[_Channel, _Channel]:
        return (self.data, self.acks)


class ShmLinks:
    """Shared-memory links from this stage to its same-host peers (see the note above).

    Made collectively by `connect`; `send(peer, tensor)` and `recv(peer, number, shape, dtype)`
    then move tensors, where `number` counts this stage's receives from `peer`, from 0, in the
    order the sender sends them.
    """

    def __init__(self, links: dict[int, _Link], timeout: float, stage: int):
        self._links = links
        self._timeout = timeout
        self._stage = stage
        #: Seconds this stage has waited for its peers' records in all (`recv`, `recv_header`):
        #: what a receive spent waiting, not taking its message ([Note: a receive's take] in
        #: `schedcc.costs`).
        self.waited = 0.0

    @property
    def peers(self) -> frozenset[int]:
        """The peer stages linked through shared memory."""
        return frozenset(self._links)

    @classmethod
    def connect(
        cls,
        process_group,
        peers: Iterable[int],
        *,
        timeout: float,
        enabled: bool = True,
        sndbuf: int | None = None,
    ) -> ShmLinks:
        """Link this rank with every stage in `peers` on the same host (collective over
        `process_group`).

        Every rank of `process_group` must call it; `peers` are ranks in it and must be symmetric
        (if a lists b, b lists a). `enabled=False` on any rank of a pair keeps that pair on gloo.
        `sndbuf` shrinks the sockets' send buffers (tests use it to exercise the record queues).
        """
        me = dist.get_rank(process_group)
        key = host_key() if enabled else None
        listener = name = None
        if key is not None:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            name = f"\0schedcc-{os.getpid()}-{secrets.token_hex(8)}"
            listener.bind(name)
            listener.listen(2 * dist.get_world_size(process_group))
            listener.settimeout(timeout)
        inline = _inline_limit(sndbuf) if key is not None else 0  # no probe where none link
        info: list = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(info, (key, name, inline), group=process_group)
        same = sorted(s for s in set(peers) if s != me and key and info[s][0] == key)
        sockets: dict[tuple[int, int], socket.socket] = {}  # (peer, 0 data | 1 acks) -> socket
        try:
            for s in (s for s in same if s < me):  # connects queue in the backlog: no waiting
                for channel in (0, 1):
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                    sock.connect(info[s][1])
                    sock.send(_RECORD.pack(_HELLO, me, channel))
                    sockets[s, channel] = sock
            for _ in range(2 * sum(s > me for s in same)):
                sock, _ = listener.accept()  # type: ignore[union-attr]
                sock.settimeout(timeout)
                _, peer, channel = _RECORD.unpack(sock.recv(_RECORD.size))
                sockets[peer, channel] = sock
        finally:
            if listener is not None:
                listener.close()
        for sock in sockets.values():
            _tune(sock, sndbuf)
        links = {s: _Link(s, sockets[s, 0], sockets[s, 1], min(inline, info[s][2])) for s in same}
        return cls(links, timeout, me)

    @classmethod
    def pair(
        cls, *, timeout: float, sndbuf: int | None = None, inline: int | None = None
    ) -> tuple[ShmLinks, ShmLinks]:
        """Stages 0 and 1 linked inside this process (for tests of the protocol itself);
        `inline` lowers the largest tensor sent inline."""
        data = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        acks = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for sock in (*data, *acks):
            _tune(sock, sndbuf)
        limit = _inline_limit(sndbuf)
        if inline is not None:
            limit = min(limit, inline)
        first = cls({1: _Link(1, data[0], acks[0], limit)}, timeout, 0)
        return first, cls({0: _Link(0, data[1], acks[1], limit)}, timeout, 1)

    # -- moving tensors -------------------------------------------------------------------------

    def send(self, peer: int, tensor: torch.Tensor) -> None:
        """Send `tensor` (contiguous, outside any graph) to `peer`, inline or through a slot;
        returns at once (never waits on the peer)."""
        link = self._links[peer]
        nbytes = tensor.nbytes
        if nbytes <= link.inline:  # see [Note: small tensors inline]
            try:
                link.data.send(_inline_header(nbytes), None, _memory(tensor))
            except OSError as exc:
                raise self._why_lost(link, exc) from exc
            return
        slot = _fitting(link, nbytes)
        if slot is None:  # take back what the peer has acknowledged since (only now: a syscall)
            self._take_acks(link)
            slot = _fitting(link, nbytes)
        if slot is None:
            fd = os.memfd_create("schedcc-slot", os.MFD_CLOEXEC)
            size = max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
            os.ftruncate(fd, size)
            link.slots.append(torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8))
            slot = len(link.slots) - 1
            new = (_RECORD.pack(_NEW, slot, size), fd)
        else:
            new = None
        key = (slot, tensor.shape, tensor.dtype)
        view = link.out_views.get(key)
        if view is None:
            view = _typed(link.slots[slot], nbytes, tensor.dtype, tensor.shape)
            link.out_views[key] = view
        view.copy_(tensor)
        try:
            if new is not None:
                link.data.send(*new)
            link.data.send(_RECORD.pack(_DATA, slot, nbytes))
        except OSError as exc:
            raise self._why_lost(link, exc) from exc

    def recv(self, peer: int, number: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """The `number`-th tensor `peer` sends this stage (0-based), waiting for it if need be."""
        link = self._links[peer]
        deadline = None
        want = (shape, dtype)
        while number not in link.arrived:
            # the next record is this receive's: an inline tensor is read straight into its own
            if not self._read(link, want if link.read == number else None):
                if deadline is None:
                    deadline = time.monotonic() + self._timeout
                self._wait(link, deadline)
        got = link.arrived.pop(number)
        if type(got) is torch.Tensor:  # it came inline
            if got.dtype is dtype and got.shape == shape:
                return got
            if got.nbytes != _nbytes(shape, dtype):  # read ahead: only its bytes were known
                raise self._disagree(link, _nbytes(shape, dtype), got.nbytes)
            return got.view(dtype).view(shape)
        slot, nbytes = got
        if nbytes != _nbytes(shape, dtype):
            raise self._disagree(link, _nbytes(shape, dtype), nbytes)
        key = (slot, tuple(shape), dtype)
        view = link.in_views.get(key)
        if view is None:
            view = link.in_views[key] = _typed(link.theirs[slot], nbytes, dtype, shape)
        out = view.clone()
        link.unacked.append(slot)
        if len(link.unacked) >= ACK_BATCH:
            self._acknowledge(link)
        return out

    def send_header(self, peer: int, words: torch.Tensor) -> None:
        """Send a message header (int64 words, at most the inline limit) in order with the
        tensors; `recv_header` reads it."""
        link = self._links[peer]
        if words.nbytes > link.inline:
            raise ValueError(
                f"a message header of {words.nbytes} bytes is over the {link.inline}-byte limit "
                "of a record: send fewer tensors and constants between two stages"
            )
        try:
            link.data.send(_RECORD.pack(_HEADER, 0, words.nbytes), None, _memory(words))
        except OSError as exc:
            raise self._why_lost(link, exc) from exc

    def recv_header(self, peer: int, number: int, want: tuple | None = None):
        """The header that is record `number` from `peer`, or None if that record holds a
        tensor (left for `recv`, read already if it is the `(shape, dtype)` `want` expects);
        waits for the record."""
        link = self._links[peer]
        deadline = None
        while True:
            got = link.arrived.get(number)
            if got is not None:
                if type(got) is not _Header:
                    return None
                del link.arrived[number]
                return got.words
            if link.read == number and want is None:
                kind = _peek(link)
                if kind is not None and kind not in (_HEADER, _NEW, _ABORT):
                    return None  # a tensor: `recv` reads it into its own buffer
            if not self._read(link, want if link.read == number else None):
                if deadline is None:
                    deadline = time.monotonic() + self._timeout
                self._wait(link, deadline)

    def _why_lost(self, link: _Link, exc: OSError | None) -> ConnectionError:
        """A send or an acknowledgement failed (`exc`; None: end of file): the peer's reason
        if it left one before it closed, else the loss. The reason is on the data channel,
        ahead of the close, whichever channel saw the close first."""
        try:
            while self._read(link, None):
                pass
        except PeerAborted as aborted:
            return aborted
        except (OSError, ValueError):
            pass
        return _lost(link, exc)

    def reason_left(self) -> str | None:
        """The reason a linked peer that failed left on its link (`abort`), if one did: read
        what has arrived, never waiting. For a collective that lost a peer: the peer's own
        line says more than the lost connection."""
        for link in self._links.values():
            try:
                while self._read(link, None):
                    pass
            except PeerAborted as aborted:
                return str(aborted)
            except (OSError, ValueError):
                continue
        return None

    def abort(self, reason: str) -> None:
        """Tell every linked peer that this stage failed, and why (never waits), and close the
        links: a peer reading from its link raises `PeerAborted` with `reason`."""
        data = reason.encode()[:1024]
        for link in self._links.values():
            with contextlib.suppress(OSError):
                record = _RECORD.pack(_ABORT, 0, len(data)) + data
                link.data.sock.send(record, socket.MSG_DONTWAIT)
        self.close()

    def close(self) -> None:
        """Close every link (the peers read end-of-file); mappings go with their last tensor."""
        for link in self._links.values():
            for channel in link.channels():
                channel.sock.close()
            for fd in link.fds:
                os.close(fd)
        self._links = {}

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # at shutdown: nothing left to tell
            self.close()

    # -- records --------------------------------------------------------------------------------

    def _acknowledge(self, link: _Link) -> None:
        """Give the peer back every slot we are done with, in one ACK record."""
        slots = array.array("I", link.unacked).tobytes()
        try:
            link.acks.send(_ACK_RECORD.pack(_ACK, len(link.unacked)) + slots)
        except OSError as exc:
            raise self._why_lost(link, exc) from exc
        link.unacked = []

    def _take_acks(self, link: _Link) -> None:
        """Take back every slot the peer has acknowledged so far; never waits."""
        sock = link.acks.sock
        while True:
            try:
                data = sock.recv(_ACK_RECORD.size + 4 * ACK_BATCH, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError as exc:
                raise self._why_lost(link, exc) from exc
            if not data:
                raise self._why_lost(link, None)
            link.free.extend(array.array("I", data[_ACK_RECORD.size :]))

    def _read(self, link: _Link, want: tuple | None) -> bool:
        """`_read_once`, read again once if the peer's close was reported ahead of its records.

        Linux reports a peer that closed with records of ours unread as one ECONNRESET, ahead of
        the records it sent before closing (its abort record among them); the next read gets
        those.
        """
        try:
            return self._read_once(link, want)
        except ConnectionError as lost:
            if not isinstance(lost.__cause__, ConnectionResetError):
                raise
            return self._read_once(link, want)

    def _read_once(self, link: _Link, want: tuple | None) -> bool:
        """Read one record from `link`'s data socket if one is there (never waits).

        `want`: the `(shape, dtype)` of the next message if known; a tensor that comes inline is
        then read into an empty tensor of that shape (see `SPARES`), else (read ahead) into a
        flat one of its bytes.
        """
        sock = link.data.sock
        tensor = None
        try:
            if want is not None:
                spares = link.spares.get(want)
                if spares is None and _nbytes(*want) <= link.inline:
                    spares = link.spares[want] = []
                if spares is not None:
                    if not spares:  # a few at once: one allocation alone, cold, costs more
                        _top_up(link, want, spares)
                    tensor, buffers = spares[-1]
                else:  # a tensor through a slot is expected: a header may come instead
                    buffers = [link.head, link.overflow]
            else:  # a record ahead of its receive: its header says how large a tensor it holds
                head = sock.recv(_RECORD.size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                if len(head) == _RECORD.size and head[0] in (_INLINE, _HEADER, _ABORT):
                    tensor = torch.empty(_RECORD.unpack(head)[2], dtype=torch.uint8)
                    buffers = [link.head, _memory(tensor)]
            if tensor is None and want is None:
                buffers = [link.head]
            size, anc, _, _ = sock.recvmsg_into(buffers, _FDS, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError as exc:
            raise _lost(link, exc) from exc
        if not size:
            raise _lost(link, None)
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                link.fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
        kind, slot, nbytes = _RECORD.unpack(link.head)
        if kind == _INLINE:
            if tensor is None or tensor.nbytes != nbytes:
                # the rest of the record is lost
                raise self._disagree(link, want and _nbytes(*want), nbytes)
            if want is not None:
                link.spares[want].pop()  # the tensor is the message's now
            link.arrived[link.read] = tensor
            link.read += 1
        elif kind == _NEW:
            fd = link.fds.popleft()
            try:
                link.theirs[slot] = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
            finally:
                os.close(fd)
        elif kind == _DATA:
            link.arrived[link.read] = (slot, nbytes)
            link.read += 1
        elif kind == _HEADER:  # read ahead, or in place of the tensor `want` expected
            words = _payload(link, tensor, nbytes, ahead=want is None)
            link.arrived[link.read] = _Header(torch.frombuffer(words, dtype=torch.int64))
            link.read += 1
        elif kind == _ABORT:
            text = _payload(link, tensor, nbytes, ahead=want is None)
            raise PeerAborted(bytes(text).decode(errors="replace"))
        else:
            raise ConnectionError(f"stage {link.peer} sent a record of unknown kind {kind}")
        return True

    def _disagree(self, link: _Link, expected: int | None, nbytes: int) -> ValueError:
        return ValueError(
            f"stage {self._stage} expected {expected} bytes from stage {link.peer} but got "
            f"{nbytes}: the two stages disagree on the tensor's shape or dtype"
        )

    def _wait(self, link: _Link, deadline: float) -> None:
        """Sleep until `link` has data or the deadline passes (counted in `waited`)."""
        start = time.perf_counter()
        try:
            self._idle(link, deadline)
        finally:
            self.waited += time.perf_counter() - start

    def _idle(self, link: _Link, deadline: float) -> None:
        """`_wait`'s body: the link's housekeeping, then spin and poll."""
        for other in self._links.values():  # idle now: settle acknowledgements both ways
            if other.unacked:
                self._acknowledge(other)
            self._take_acks(other)
            for want, spares in other.spares.items():  # and allocate what later receives need
                if len(spares) < SPARES:
                    _top_up(other, want, spares)
        poller = select.poll()
        poller.register(link.data.sock, select.POLLIN)
        spin_until = min(deadline, time.monotonic() + SPIN)
        while not poller.poll(0):
            if time.monotonic() >= spin_until:
                break
            os.sched_yield()
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise TimeoutError(
                f"stage {self._stage} waited {self._timeout:.0f} s for stage {link.peer}"
            )


def _send(sock: socket.socket, record: bytes, fd: int | None, flags: int, payload=None) -> None:
    if payload is not None:
        sock.sendmsg([record, payload], (), flags)
        return
    if fd is None:
        sock.send(record, flags)
        return
    sock.sendmsg([record], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))], flags)
    os.close(fd)  # the peer holds its own copy now; our mapping stays


def _payload(link: _Link, tensor: torch.Tensor | None, nbytes: int, *, ahead: bool) -> bytearray:
    """The `nbytes` of a header or abort record: read ahead into `tensor`, or spread over the
    tensor expected in its place and the link's overflow buffer."""
    if ahead:
        return bytearray(bytes(_memory(tensor)))  # type: ignore[arg-type]
    first = bytes(_memory(tensor)) if tensor is not None else b""
    return bytearray((first + bytes(link.overflow))[:nbytes])


def _peek(link: _Link) -> int | None:
    """The kind of the next record on `link`'s data socket, or None if none is there yet (a
    reset is read past once, as `ShmLinks._read` does)."""
    for attempt in (0, 1):
        try:
            head = link.data.sock.recv(_RECORD.size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            break
        except BlockingIOError:
            return None
        except ConnectionResetError as exc:
            if attempt:
                raise _lost(link, exc) from exc
        except OSError as exc:
            raise _lost(link, exc) from exc
    if not head:
        raise _lost(link, None)
    return head[0]


def _top_up(link: _Link, want: tuple, spares: list) -> None:
    """Fill `spares` (of `link`, for tensors shaped `want`) back up to `SPARES`."""
    empties = [torch.empty(want[0], dtype=want[1]) for _ in range(SPARES - len(spares))]
    spares[:0] = [(empty, [link.head, _memory(empty), link.overflow]) for empty in empties]


def _memory(tensor: torch.Tensor):
    """A buffer over a contiguous CPU tensor's bytes (no copy), for the socket to read or fill.

    It does not keep the tensor alive: the caller holds the tensor while the buffer is in use.
    (A ctypes array rather than `tensor.numpy()`: any dtype, and 3 us less right after a compute.)
    """
    return _bytes_type(tensor.nbytes).from_address(tensor.data_ptr())


@functools.cache
def _bytes_type(nbytes: int) -> type:
    return ctypes.c_char * nbytes


@functools.cache
def _inline_header(nbytes: int) -> bytes:
    return _RECORD.pack(_INLINE, 0, nbytes)


@functools.cache
def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _typed(slot: torch.Tensor, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
    """The first `nbytes` of a uint8 `slot` seen as a contiguous `shape` tensor of `dtype`."""
    return slot[:nbytes].view(dtype).view(shape)


def _fitting(link: _Link, nbytes: int) -> int | None:
    """Take one of our free slots on `link` that holds `nbytes`, if any: the last one freed,
    unless it is too small (the sizes a stage sends are few, so that is rare)."""
    free, slots = link.free, link.slots
    for k in range(len(free) - 1, -1, -1):
        if slots[free[k]].numel() >= nbytes:
            return free.pop(k)
    return None


def _inline_limit(sndbuf: int | None) -> int:
    """The largest tensor this process sends inline over a socket tuned with `sndbuf`: at most
    `INLINE`, and a quarter of what the socket holds (a record larger than the send buffer
    cannot be sent at all, and a few must fit at once)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        _tune(probe, sndbuf)
        room = probe.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    return max(0, min(INLINE, room // 4 - _RECORD.size))


def _tune(sock: socket.socket, sndbuf: int | None) -> None:
    sock.setblocking(True)  # waits go through poll; non-blocking calls pass MSG_DONTWAIT
    if sndbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)


def _lost(link: _Link, exc: OSError | None) -> ConnectionError:
    why = f": {exc}" if exc is not None else " (end of file)"
    return ConnectionError(f"stage {link.peer} closed the link{why}")
