"""The transport's fences (``kvtriton.transport.fence``) alone, over a stand-in transport: which
peers are fenced, when, how often, and what a forgotten peer leaves to retire."""

import pytest

from kvtriton.errors import TransportError
from kvtriton.transport.fence import FENCE_BYTES, Fences
from kvtriton.transport.handles import PreppedList, Xfer, XferStatus


class StandIn:
    """What :class:`Fences` calls on a transport, recorded; transfers stay in flight until ``land``."""

    def __init__(self):
        self.posts: list[tuple[str, object]] = []
        self.released: list[Xfer] = []
        self.landed: set[int] = set()
        self.fences = Fences(self)

    def prep_local(self, descs, mem):
        assert descs.tolist() == [[4096, FENCE_BYTES, 0]]
        return PreppedList("", mem, 1, None)

    def prep_remote(self, agent, descs, mem):
        if agent == "gone":
            raise TransportError("unknown peer")
        return PreppedList(agent, mem, 1, descs.tolist())

    def post(self, op, local, local_idx, remote, remote_idx, notif=b""):
        x = Xfer(op, remote.agent, 1, None)
        self.posts.append((remote.agent, remote._handle))
        self.fences.posted(remote.agent)  # as NixlTransport.post does
        return x

    def repost(self, x, notif=None):
        self.posts.append((x.remote, "again"))
        self.landed.discard(id(x))
        return XferStatus.PROC

    def poll(self, x):
        return XferStatus.DONE if id(x) in self.landed else XferStatus.PROC

    def release(self, x):
        self.released.append(x)

    def land(self):
        self.landed.update(id(f.xfer) for f in self.fences.peers.values() if f.xfer is not None)


def test_only_peers_posted_to_are_fenced_once_per_message_burst():
    t = StandIn()
    f = t.fences
    f.add("src", 1 << 20, 0, "DRAM")
    f.add("quiet", 2 << 20, 0, "DRAM")
    f.sent("src")
    f.sent("quiet")
    f.flush()
    assert t.posts == []  # not armed yet: nothing to READ into
    f.arm(4096, 0, "DRAM")
    f.flush()
    assert t.posts == []  # messages only: a fence of ours would make the peer wait on us
    f.posted("src")
    f.sent("src")
    f.sent("stranger")  # not a peer named by add: ignored
    f.flush()
    assert t.posts == [("src", [[1 << 20, FENCE_BYTES, 0]])]
    assert f.state("src") == {"fences": 1, "fencing": True, "unflushed": False}
    f.sent("src")
    f.flush()  # one fence per peer at a time: the next waits for this one to land
    assert len(t.posts) == 1 and f.state("src")["unflushed"]
    t.land()
    f.flush()  # the same transfer posted again: none made or released per fence
    assert t.posts[1] == ("src", "again") and t.released == []
    assert f.state("src") == {"fences": 2, "fencing": True, "unflushed": False}
    assert f.state("quiet") == {"fences": 0, "fencing": False, "unflushed": True}
    assert f.state("stranger") == {"fences": 0, "fencing": False, "unflushed": False}


def test_forget_hands_back_the_fence_in_flight_and_failures_are_logged():
    t = StandIn()
    f = t.fences
    f.arm(4096, 0, "DRAM")
    f.add("src", 1 << 20, 0, "DRAM")
    f.add("gone", 3 << 20, 0, "DRAM")
    for agent in ("src", "gone"):
        f.posted(agent)
        f.sent(agent)
    f.flush()  # the one to "gone" cannot be prepared: logged, the other peers still fenced
    assert [p[0] for p in t.posts] == ["src"]
    inflight = f.peers["src"].xfer
    assert f.forget("src") is inflight and f.forget("src") is None
    f.sent("src")
    f.flush()
    assert [p[0] for p in t.posts] == ["src"]


def test_a_peers_fence_transfer_is_kept_until_forget_disarm_or_a_new_registration():
    """One transfer per peer for all its fences: a landed one is kept (posted again at the next
    burst), handed back by forget, released by disarm (made from the list over our buffer) and
    when the agent is added again; a repost that fails drops it, the next fence makes a new one."""
    t = StandIn()
    f = t.fences
    f.arm(4096, 0, "DRAM")
    for agent in ("a", "b", "c"):
        f.add(agent, 1 << 20, 0, "DRAM")
        f.posted(agent)
        f.sent(agent)
    f.flush()
    t.land()
    f.flush()  # landed, nothing sent since: kept, not released, not posted again
    kept = {a: f.peers[a].xfer for a in "abc"}
    assert len(t.posts) == 3 and t.released == [] and all(not f.state(a)["fencing"] for a in "abc")
    assert f.forget("a") is kept["a"]  # the caller retires it
    f.add("b", 2 << 20, 0, "DRAM")  # b registered again: its old transfer is released
    assert t.released == [kept["b"]] and f.peers["b"].xfer is None

    def refuse(x, notif=None):
        raise TransportError("gone")

    t.repost = refuse
    f.sent("c")
    f.flush()  # logged; the transfer released, a fresh one next time
    assert t.released == [kept["b"], kept["c"]] and f.peers["c"].xfer is None
    f.sent("c")
    f.flush()
    assert len(t.posts) == 4 and f.peers["c"].xfer is not None
    assert f.disarm() is not None and t.released[-1] is not kept["c"] and f.peers["c"].xfer is None


@pytest.mark.nixl
def test_a_notification_on_a_transfer_needs_a_fence_as_a_message_does():
    """Over real NIXL (two agents in this process): a READ carrying a notification leaves the
    endpoint waiting on the peer's next progress as a message does (the next READ stays in
    flight until the peer progresses), so the transport marks the peer for a fence after a post or
    repost with one, and not after a plain READ (which leaves the endpoint as it was)."""
    import time

    import numpy as np
    import torch

    from kvtriton.transport.nixl import NixlTransport

    a, b = NixlTransport("fence-a"), NixlTransport("fence-b")
    try:
        gen = torch.Generator().manual_seed(7)  # fresh random bytes on both sides: a READ that moves none shows
        ta, tb = (torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=gen) for _ in range(2))
        want = bytes(tb[:4 * 4096].numpy())
        a.register([ta])
        b.register([tb])
        peer = a.add_remote(b.metadata())
        b.add_remote(a.metadata())
        a.fences.add(peer, tb.data_ptr(), 0, "DRAM")
        descs = lambda t: np.array([[t.data_ptr() + i * 4096, 4096, 0] for i in range(4)], dtype=np.int64)  # noqa: E731
        local, remote = a.prep_local(descs(ta), "DRAM"), a.prep_remote(peer, descs(tb), "DRAM")
        idx = np.arange(4)

        def read(notif=b"", peer_progresses=True):
            x = a.post("READ", local, idx, remote, idx, notif)
            deadline = time.monotonic() + 0.2
            while a.poll(x) is not XferStatus.DONE:
                if peer_progresses or time.monotonic() > deadline:
                    b.poll_notifs()
            a.release(x)

        for _ in range(3):  # wired up
            read()
        read(peer_progresses=False)
        assert a.fences.state(peer)["unflushed"] is False
        read(notif=b"landed")
        assert a.fences.state(peer)["unflushed"] is True
        x = a.post("READ", local, idx, remote, idx)
        a.fences.peers[peer].unflushed = False
        while a.poll(x) is not XferStatus.DONE:
            b.poll_notifs()
        a.repost(x, b"again")
        assert a.fences.state(peer)["unflushed"] is True
        while a.poll(x) is not XferStatus.DONE:
            b.poll_notifs()
        a.release(x)
        assert bytes(ta[:4 * 4096].numpy()) == want and bytes(tb[:4 * 4096].numpy()) == want
    finally:
        a.close()
        b.close()
