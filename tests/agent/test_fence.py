"""The transport's fences (``kvtriton.transport.fence``) alone, over a stand-in transport: which
peers are fenced, when, how often, and what a forgotten peer leaves to retire."""

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
    f.flush()
    assert len(t.posts) == 2 and len(t.released) == 1
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
