"""Same-host point-to-point through shared memory (`backends.distributed.shm`): the protocol itself.

Two linked stages live in this process (`ShmLinks.pair`), so a test drives both ends and can
check what a real pipeline cannot: any order of sends and receives, tiny socket buffers (the
record queues), a receive waited ahead of earlier ones, end of file and timeouts. The distributed
backend's equality and failure tests (`test_distributed.py`) run the same links across processes.
"""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from schedcc.backends.distributed import shm as _shm
from schedcc.backends.distributed.shm import ShmLinks, host_key

pytestmark = pytest.mark.skipif(host_key() is None, reason="needs Linux memfd and Unix sockets")

DTYPES = [torch.float32, torch.float64, torch.int64, torch.bool, torch.bfloat16]

#: A message: (sender stage, shape, dtype index).
messages = st.lists(
    st.tuples(
        st.integers(0, 1),
        st.lists(st.integers(0, 40), min_size=0, max_size=3),
        st.integers(0, len(DTYPES) - 1),
    ),
    max_size=60,
)


def _tensor(shape, dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 100, shape, generator=generator)
    return values.to(dtype)


@given(
    messages,
    st.randoms(use_true_random=False),
    st.sampled_from([None, 4096]),
    st.sampled_from([None, 0, 64]),
)
def test_every_tensor_arrives_once_in_its_place(plan, random, sndbuf, inline):
    """Random sends both ways, each receive at a random later moment: every tensor bit-exact,
    whether it went inline, through a slot, or (`inline=64`) either way in one stream."""
    # a lost message fails fast, shrinks fast
    links = ShmLinks.pair(timeout=1, sndbuf=sndbuf, inline=inline)
    sent: list[list[torch.Tensor]] = [[], []]  # by sender: what it sent, in order
    pending: list[tuple[int, int]] = []  # (sender, number) not yet received
    for seed, (sender, shape, code) in enumerate(plan):
        tensor = _tensor(shape, DTYPES[code], seed)
        links[sender].send(1 - sender, tensor)
        pending.append((sender, len(sent[sender])))
        sent[sender].append(tensor)
        while pending and random.random() < 0.4:  # receive some, in any order
            sender_, number = pending.pop(random.randrange(len(pending)))
            _check(links, sent, sender_, number)
    random.shuffle(pending)
    for sender, number in pending:
        _check(links, sent, sender, number)
    for link in links:
        link.close()


def _check(links, sent, sender: int, number: int) -> None:
    want = sent[sender][number]
    got = links[1 - sender].recv(sender, number, tuple(want.shape), want.dtype)
    assert got.dtype == want.dtype
    assert torch.equal(got, want)


def test_slots_are_reused_once_acknowledged():
    """A steady stream needs as many slots as messages in flight plus an ACK batch, whatever its
    length; a larger message gets a slot of its own."""
    a, b = ShmLinks.pair(timeout=5, inline=0)
    for number in range(50):
        a.send(1, torch.full((64, 64), float(number)))
        assert b.recv(0, number, (64, 64), torch.float32)[0, 0].item() == number
    assert 1 <= len(a._links[1].slots) <= _shm.ACK_BATCH + 1
    before = len(a._links[1].slots)
    a.send(1, torch.zeros(1024, 64))  # larger than any slot: a new one
    assert len(a._links[1].slots) == before + 1


def test_a_receiver_about_to_wait_acknowledges_what_it_holds():
    """Acknowledgements wait for a batch, except when the receiver waits: then all go back."""
    a, b = ShmLinks.pair(timeout=0.05, inline=0)
    a.send(1, torch.ones(3))
    b.recv(0, 0, (3,), torch.float32)
    assert b._links[0].unacked == [0]  # one slot: not yet a batch
    with pytest.raises(TimeoutError):
        b.recv(0, 1, (3,), torch.float32)  # nothing sent: it waits, acknowledging first
    assert b._links[0].unacked == []
    a.send(1, torch.ones(3))
    assert len(a._links[1].slots) == 1  # the acknowledged slot was reused


def test_sends_never_wait_even_when_the_socket_is_full():
    """Both stages send hundreds of messages before either receives: queued, then delivered."""
    a, b = ShmLinks.pair(timeout=5, sndbuf=4096)
    for number in range(300):
        a.send(1, torch.tensor([number]))
        b.send(0, torch.tensor([-number]))
    assert a._links[1].data.backlog  # the socket did not take them all: a thread sends the rest
    for number in range(300):
        assert b.recv(0, number, (1,), torch.int64).item() == number
        assert a.recv(1, number, (1,), torch.int64).item() == -number


def test_a_message_arrives_though_its_sender_does_nothing_more():
    """What a full socket could not take still arrives while the sender's thread does nothing
    (computes, or waits in a collective): the receiver gets the last message first."""
    a, b = ShmLinks.pair(timeout=5, sndbuf=4096)
    for number in range(300):
        a.send(1, torch.tensor([number]))
    assert b.recv(0, 299, (1,), torch.int64).item() == 299
    assert b.recv(0, 0, (1,), torch.int64).item() == 0


def test_a_closed_peer_ends_the_wait_at_once():
    a, b = ShmLinks.pair(timeout=30)
    a.close()
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="stage 0 closed the link"):
        b.recv(0, 0, (1,), torch.float32)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("path", ["recv", "send"])
def test_a_peer_that_aborts_with_our_records_unread_gives_its_reason(path):
    """A peer that fails with records of ours unread, and says why before it closes: the reason
    arrives on the receive and the send path, not the kernel's reset reported ahead of it."""
    a, b = ShmLinks.pair(timeout=5)
    b.send(0, torch.tensor([1.0]))  # never read by stage 0: its close is then a reset
    a.abort("stage 0 failed at RA3: a shape disagrees")
    then = (
        (lambda: b.recv(0, 0, (1,), torch.float32))
        if path == "recv"
        else (lambda: b.send(0, torch.tensor([2.0])))
    )
    with pytest.raises(_shm.PeerAborted, match="failed at RA3"):
        then()


def test_a_peer_that_aborts_before_a_slot_is_taken_back_gives_its_reason():
    """A send through a slot first takes back what the peer acknowledged, on the other
    channel: a peer gone with its reason said gives that reason there too, not the end of
    file the acknowledgements' channel reads."""
    a, b = ShmLinks.pair(timeout=5)
    a.abort("stage 0 failed at RA3: a shape disagrees")
    with pytest.raises(_shm.PeerAborted, match="failed at RA3"):
        b.send(0, torch.zeros(100_000))  # too large to go inline: a slot is needed


def test_a_peer_that_aborts_as_we_are_about_to_wait_gives_its_reason(monkeypatch):
    """The race a two-rank failure test met: the receiver looks, finds nothing, and the peer
    aborts before it waits. Waiting first settles the acknowledgements, whose channel reads
    the close; the reason, sent ahead of the close, is what the receiver reports."""
    a, b = ShmLinks.pair(timeout=5)
    looked = b._read

    def read_then_abort(link, want):
        got = looked(link, want)
        if not got and a.peers:  # after the first look, before the wait
            a.abort("stage 0 failed at RA3: a shape disagrees")
        return got

    monkeypatch.setattr(b, "_read", read_then_abort)
    with pytest.raises(_shm.PeerAborted, match="failed at RA3"):
        b.recv(0, 0, (1,), torch.float32)


def test_a_wait_past_the_timeout_raises(monkeypatch):
    monkeypatch.setattr(_shm, "SPIN", 0.01)
    _, b = ShmLinks.pair(timeout=0.2)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="stage 1 waited"):
        b.recv(0, 0, (1,), torch.float32)
    assert 0.2 <= time.monotonic() - start < 5


@pytest.mark.parametrize("inline", [None, 0])
def test_a_shape_that_disagrees_with_the_sender_raises(inline):
    a, b = ShmLinks.pair(timeout=5, inline=inline)
    a.send(1, torch.zeros(3))
    with pytest.raises(ValueError, match="expected 16 bytes from stage 0 but got 12"):
        b.recv(0, 0, (4,), torch.float32)


@pytest.mark.parametrize("inline", [None, 0])
def test_a_shape_that_disagrees_raises_when_read_ahead_too(inline):
    """The first message is read while the second's receive waits, before its shape is known."""
    a, b = ShmLinks.pair(timeout=5, inline=inline)
    a.send(1, torch.zeros(3))
    a.send(1, torch.ones(2))
    assert torch.equal(b.recv(0, 1, (2,), torch.float32), torch.ones(2))
    with pytest.raises(ValueError, match="expected 16 bytes from stage 0 but got 12"):
        b.recv(0, 0, (4,), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_tensors_go_inline_and_large_ones_through_slots(dtype):
    """A tensor up to the pair's limit needs no slot and no acknowledgement; a larger one does."""
    a, b = ShmLinks.pair(timeout=5)
    link = a._links[1]
    small = torch.arange(link.inline // dtype.itemsize).to(dtype)
    got = []
    for number in range(20):
        a.send(1, small + number)
        got.append(b.recv(0, number, small.shape, dtype))
    for number, tensor in enumerate(got):  # each its own tensor, none overwritten since
        assert torch.equal(tensor, small + number)
    assert link.slots == []
    assert b._links[0].unacked == []
    large = torch.arange(link.inline // dtype.itemsize + 1).to(dtype)
    a.send(1, large)
    assert torch.equal(b.recv(0, 20, large.shape, dtype), large)
    assert len(link.slots) == 1
    assert b._links[0].unacked == [0]


def test_host_key_names_this_kernel_and_network_namespace():
    key = host_key()
    assert key == host_key()
    boot, netns = key.split("/")
    assert len(boot) == 36
    assert int(netns) > 0


def test_a_receiver_about_to_wait_tops_up_its_empty_tensors(monkeypatch):
    """Inline receives take empty tensors allocated `SPARES` at a time; a rank about to wait
    allocates the ones used since, so the next receives find theirs ready."""
    monkeypatch.setattr(_shm, "SPIN", 0.001)
    a, b = ShmLinks.pair(timeout=0.05)
    for number in range(3):
        a.send(1, torch.full((4,), float(number)))
        assert b.recv(0, number, (4,), torch.float32)[0].item() == number
    spares = b._links[0].spares[(4,), torch.float32]
    assert len(spares) == _shm.SPARES - 3
    with pytest.raises(TimeoutError):
        b.recv(0, 3, (4,), torch.float32)  # nothing sent: it waits, topping up first
    assert len(spares) == _shm.SPARES
    a.send(1, torch.full((4,), 3.0))
    assert torch.equal(b.recv(0, 3, (4,), torch.float32), torch.full((4,), 3.0))


def test_where_no_link_can_be_made_connect_makes_no_socket(monkeypatch):
    """Without memfd or SEQPACKET sockets (`host_key()` None: not Linux) the pair stays on gloo
    and `connect` opens no socket at all, not even to size its records."""
    import torch.distributed as dist

    def no_sockets(*args, **kwargs):
        raise AssertionError("connect opened a socket")

    monkeypatch.setattr(_shm, "host_key", lambda: None)
    monkeypatch.setattr(_shm.socket, "socket", no_sockets)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        links = ShmLinks.connect(dist.group.WORLD, [], timeout=5)
    finally:
        dist.destroy_process_group()
    assert links.peers == frozenset()


def test_a_disagreeing_shape_raises_even_in_a_slot_already_seen():
    """The size check is per message, not per slot: a reused slot whose typed view is cached
    still refuses a message of another size."""
    a, b = ShmLinks.pair(timeout=5, inline=0)
    a.send(1, torch.ones(4))
    assert torch.equal(b.recv(0, 0, (4,), torch.float32), torch.ones(4))
    b._acknowledge(b._links[0])  # slot 0 goes back to the sender, which reuses it
    a.send(1, torch.zeros(3))
    assert len(a._links[1].slots) == 1  # the same slot, reused
    with pytest.raises(ValueError, match="expected 16 bytes from stage 0 but got 12"):
        b.recv(0, 1, (4,), torch.float32)
