"""kvtriton.transport.nixl against real NIXL (UCX), between processes on 127.0.0.1.

The peer ("target") is a child process running ``_TARGET_SRC``: it registers a random ``src`` and
a zeroed ``dst`` buffer, prints its metadata, then polls its agent every 0.5 ms while serving
one-line JSON commands on stdin. This process is the initiator. Metadata travels over the pipes,
never over NIXL's listener. Every wait is bounded, and children are killed on any exit.
"""

from __future__ import annotations

import base64
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("nixl")

from kvtriton.transport.nixl import (  # noqa: E402
    NixlTransport,
    PeerDisconnectedError,
    TransportError,
    XferStatus,
)

pytestmark = pytest.mark.nixl

REPO = Path(__file__).resolve().parents[2]
SIZE = 1 << 20  # bytes in each of the target's buffers
SLOTS = 16  # equal, adjacent slots per buffer
SLOT = SIZE // SLOTS
STARTUP_S = 60.0  # a child imports torch + nixl (~2 s here); generous for loaded CI machines
REPLY_S = 10.0

_TARGET_SRC = r"""
import base64, json, os, selectors, sys
out = os.fdopen(os.dup(1), "w")  # replies only; anything else printed goes to stderr
os.dup2(2, 1)
import torch
from kvtriton.transport.nixl import NixlTransport

name, size, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
src = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
dst = torch.zeros(size, dtype=torch.uint8)
t = NixlTransport(name)
t.register([src, dst])

def reply(**kw):
    out.write(json.dumps(kw) + "\n")
    out.flush()

reply(md=t.metadata().hex(), src=src.data_ptr(), dst=dst.data_ptr())
sel = selectors.DefaultSelector()
sel.register(sys.stdin, selectors.EVENT_READ)
got = {}
while True:
    for k, v in t.poll_notifs().items():  # also drives this passive agent's progress
        got.setdefault(k, []).extend(m.hex() for m in v)
    if not sel.select(0.0005):
        continue
    line = sys.stdin.readline()
    if not line:
        break  # the initiator is gone
    cmd = json.loads(line)
    c = cmd["cmd"]
    if c == "notifs":
        reply(notifs=got)
        got = {}
    elif c == "bytes":
        buf = src if cmd["which"] == "src" else dst
        reply(data=base64.b64encode(buf.numpy().tobytes()).decode())
    elif c == "add":
        reply(name=t.add_remote(bytes.fromhex(cmd["md"])))
    elif c == "send":
        try:
            t.send_notif(cmd["to"], bytes.fromhex(cmd["msg"]))
            reply(ok=True)
        except Exception as e:
            reply(error=type(e).__name__, message=str(e))
    elif c == "exit":
        t.close()
        reply(ok=True)
        break
"""


class _Peer:
    """A target child process and its JSON-line control pipe."""

    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        self._err = tempfile.TemporaryFile()
        path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=path)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _TARGET_SRC, name, str(SIZE), str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, env=env, cwd=REPO,
        )
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            hello = self._read(STARTUP_S)
        except BaseException:
            self.kill()
            raise
        self.md = bytes.fromhex(hello["md"])
        self.src_addr, self.dst_addr = hello["src"], hello["dst"]

    def request(self, pump=None, timeout: float = REPLY_S, **cmd) -> dict:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        return self._read(timeout, pump)

    def _read(self, timeout: float, pump=None) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pump is not None:
                pump()  # keep our own agent progressing while the peer works
            if self._sel.select(0.0005):
                line = self.proc.stdout.readline()
                if not line:
                    break
                return json.loads(line)
        rc = self.proc.poll()
        raise RuntimeError(f"peer {self.name!r} did not answer within {timeout} s (rc={rc}):\n{self.stderr()}")

    def data(self, which: str) -> bytes:
        return base64.b64decode(self.request(cmd="bytes", which=which)["data"])

    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")[-4000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._sel.close()
        self._err.close()

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.request(cmd="exit")
                self.proc.wait(timeout=10)
        except Exception:
            pass
        finally:
            self.kill()


def _wait(t: NixlTransport, x, timeout: float = REPLY_S) -> XferStatus:
    deadline = time.monotonic() + timeout
    while t.poll(x) is XferStatus.PROC:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{x.op} still in progress after {timeout} s")
        t.poll_notifs()
    return x.status


def _slots(base: int) -> np.ndarray:
    return np.array([(base + i * SLOT, SLOT, 0) for i in range(SLOTS)], dtype=np.uint64)


class _Pair:
    def __init__(self, t: NixlTransport, peer: _Peer) -> None:
        self.t, self.peer = t, peer
        self.inbox: dict[str, list[bytes]] = {}
        self.remote = t.add_remote(peer.md)
        self.buf = torch.zeros(SIZE, dtype=torch.uint8)
        t.register(self.buf)
        self.local = t.prep_local(_slots(self.buf.data_ptr()), "DRAM")
        self.src = t.prep_remote(self.remote, _slots(peer.src_addr), "DRAM")
        self.dst = t.prep_remote(self.remote, _slots(peer.dst_addr), "DRAM")

    def pump(self) -> None:
        for k, v in self.t.poll_notifs().items():
            self.inbox.setdefault(k, []).extend(v)


@pytest.fixture(scope="module")
def pair():
    peer = _Peer(f"target-{os.getpid()}", seed=7)
    t = None
    try:
        t = NixlTransport(f"initiator-{os.getpid()}")
        yield _Pair(t, peer)
    finally:
        if t is not None:
            t.close()
        peer.close()


def test_read_round_trip(pair):
    t = pair.t
    src = pair.peer.data("src")
    assert pair.remote == pair.peer.name and isinstance(pair.remote, str)
    pair.buf.zero_()
    idx = np.arange(SLOTS)
    x = t.post("READ", pair.local, idx, pair.src, idx, notif=b"read-1")
    assert _wait(t, x) is XferStatus.DONE
    assert pair.buf.view(torch.uint8).numpy().tobytes() == src
    t.release(x)

    # A permutation: local slot i <- remote slot perm[i], with a repeated and a skipped slot.
    pair.buf.zero_()
    perm = np.array([5, 0, 15, 3, 3, 9, 1, 2, 4, 6, 7, 8, 10, 11, 12, 13])
    x = t.post("READ", pair.local, np.arange(SLOTS, dtype=np.int32), pair.src, perm)
    assert _wait(t, x) is XferStatus.DONE
    got = pair.buf.numpy().tobytes()
    for i, j in enumerate(perm):
        assert got[i * SLOT:(i + 1) * SLOT] == src[j * SLOT:(j + 1) * SLOT], f"slot {i} <- {j}"
    t.release(x)
    t.release(x)  # idempotent

    # the notification follows the data and reaches the peer at its next progress: wait for it (a
    # stalled host delays it past one look, and a late one would land in the next test's)
    deadline = time.monotonic() + REPLY_S
    notifs: dict = {}
    while not notifs.get(t.name) and time.monotonic() < deadline:
        notifs = pair.peer.request(cmd="notifs", pump=pair.pump)["notifs"]
    assert notifs == {t.name: [b"read-1".hex()]}


def test_write_round_trip_with_notif(pair):
    t = pair.t
    payload = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(11))
    pair.buf.copy_(payload)
    idx = list(range(SLOTS))
    x = t.post("WRITE", pair.local, idx, pair.dst, idx, notif=b"write-1")
    assert _wait(t, x) is XferStatus.DONE
    # Repost the same request (data copied again, the creation notif sent again).
    assert t.repost(x) is XferStatus.DONE or _wait(t, x) is XferStatus.DONE
    t.release(x)

    deadline = time.monotonic() + REPLY_S
    got: list[str] = []
    while len(got) < 2 and time.monotonic() < deadline:  # the notif follows the data
        got += pair.peer.request(cmd="notifs", pump=pair.pump)["notifs"].get(t.name, [])
    assert got == [b"write-1".hex()] * 2
    assert pair.peer.data("dst") == payload.view(torch.uint8).numpy().tobytes()


def test_notifs_need_metadata_on_the_sender(pair):
    t, peer = pair.t, pair.peer
    t.send_notif(pair.remote, b"ping")
    deadline = time.monotonic() + REPLY_S
    got: dict = {}
    while not got.get(t.name) and time.monotonic() < deadline:
        got = peer.request(cmd="notifs", pump=pair.pump)["notifs"]
    assert got == {t.name: [b"ping".hex()]}

    # The target has received from us but cannot answer until it has loaded our metadata.
    r = peer.request(cmd="send", to=t.name, msg=b"pong".hex(), pump=pair.pump)
    assert r.get("error") == "TransportError", r
    assert peer.request(cmd="add", md=t.metadata().hex(), pump=pair.pump) == {"name": t.name}
    assert peer.request(cmd="send", to=t.name, msg=b"pong".hex(), pump=pair.pump) == {"ok": True}
    deadline = time.monotonic() + REPLY_S
    while not pair.inbox.get(peer.name) and time.monotonic() < deadline:
        pair.pump()
    assert pair.inbox.pop(peer.name) == [b"pong"]  # keyed by the sender's name, as str


def _disconnect_scenario(tag: str, *, full: bool = True, close: bool = True) -> dict[str, float]:
    """Connect, READ once, SIGKILL the peer, then check every call fails fast and typed.

    ``full=False`` stops after the first failed post; ``close=False`` leaves the transport for
    the process exit to tear down.
    """
    peer = _Peer(f"doomed-{tag}-{os.getpid()}", seed=3)
    t = NixlTransport(f"survivor-{tag}-{os.getpid()}")
    try:
        p = _Pair(t, peer)
        x = t.post("READ", p.local, [0, 1], p.src, [2, 3])
        assert _wait(t, x) is XferStatus.DONE
        t.send_notif(p.remote, b"alive")

        os.kill(peer.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        peer.proc.wait(timeout=10)
        timings = {}
        with pytest.raises(PeerDisconnectedError) as ei:
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:  # bounded: the first post after the kill raises here
                t.release(t.post("READ", p.local, [0], p.src, [0]))
                t.poll_notifs()
        timings["post"] = time.monotonic() - t0
        assert ei.value.peer == p.remote
        if not full:
            return timings
        with pytest.raises(PeerDisconnectedError):
            t.repost(x)
        with pytest.raises(PeerDisconnectedError):
            t.poll(x)  # NIXL raises for the old request too, it never reports ERR here
        with pytest.raises(PeerDisconnectedError):
            t.send_notif(p.remote, b"anyone?")
        t1 = time.monotonic()
        assert t.poll_notifs() == {}  # does not hang
        timings["poll_notifs"] = time.monotonic() - t1
        t.release(x)
        return timings
    finally:
        if close:
            t.close()
        peer.kill()


def test_peer_killed_raises_peer_disconnected():
    timings = _disconnect_scenario("inproc")
    assert timings["post"] < 2.0, timings
    assert timings["poll_notifs"] < 0.5, timings


def test_process_exits_cleanly_after_disconnect():
    """A request that failed on a dead peer makes UCX abort the process at exit (SIGABRT in
    ``ucs_arbiter_group_is_empty``) unless the worker is driven once more; the wrapper does that
    when it translates the error. Fail one post, call nothing else, exit, check rc."""
    code = (
        "import runpy, sys; sys.path[:0] = [sys.argv[1]]\n"
        "m = runpy.run_path(sys.argv[2], run_name='disconnect_child')  # this module's code, not a test run\n"
        "print('timings', m['_disconnect_scenario']('sub', full=False, close=False))\n"
    )
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    try:
        r = subprocess.run(
            [sys.executable, "-c", code, str(REPO), str(Path(__file__).resolve())],
            capture_output=True, text=True, timeout=120, env=env, cwd=REPO,
        )
    except subprocess.TimeoutExpired as e:  # run() kills the child on timeout
        pytest.fail(f"disconnect scenario timed out: {e}")
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    assert "timings" in r.stdout


def test_single_agent_validation_and_loopback():
    with NixlTransport(f"solo-{os.getpid()}") as t:
        a = torch.randint(0, 256, (4096,), dtype=torch.uint8)
        b = torch.zeros(4096, dtype=torch.uint8)
        reg = t.register([a, b])
        assert reg.mem_type == "DRAM" and reg.nbytes == 8192

        with pytest.raises(ValueError, match="VRAM"):
            t.register(torch.zeros(16, dtype=torch.uint8), "VRAM")
        if not torch.cuda.is_available():
            with pytest.raises(ValueError, match="CUDA"):
                t.register([(a.data_ptr(), 16)], "VRAM")  # never probed: it would break the agent
        with pytest.raises(ValueError, match="contiguous"):
            t.register(torch.zeros(8, 8)[:, ::2])
        with pytest.raises(ValueError):
            t.register([])
        c = torch.zeros(2, 256, dtype=torch.int32)
        raw = t.register([(c.data_ptr(), 1024), (c.data_ptr() + 1024, 1024, 0)], "DRAM")
        arr = t.register(np.array([(c.data_ptr(), 2048, 0)]), "DRAM")
        assert raw.nbytes == arr.nbytes == 2048
        t.deregister(raw)
        t.deregister(arr)

        descs = np.array([(b.data_ptr() + i * 1024, 1024, 0) for i in range(4)], dtype=np.uint64)
        loc = t.prep_local(descs, "DRAM")
        # One strided row (addr, len, dev, stride, count) stands for 4 descriptors.
        rem = t.prep_remote(t.name, np.array([(a.data_ptr(), 1024, 0, 1024, 4)], dtype=np.int64), "DRAM")
        assert (loc.count, rem.count) == (4, 4)

        with pytest.raises(TypeError):
            t.prep_local([(b.data_ptr(), 1024, 0)], "DRAM")  # tuples: not accepted
        with pytest.raises(ValueError):
            t.prep_local(np.zeros((2, 2), dtype=np.uint64), "DRAM")
        with pytest.raises(ValueError, match="mem_type"):
            t.prep_local(np.array([(b.data_ptr(), 8, 0)]), "cpu")
        with pytest.raises(TransportError):
            t.prep_local(np.array([(b.data_ptr(), 1 << 20, 0)]), "DRAM")  # outside the registration
        with pytest.raises(TransportError, match="add_remote"):
            t.prep_remote("nobody", np.array([(1, 8, 0)]), "DRAM")
        with pytest.raises(ValueError, match="op"):
            t.post("read", loc, [0], rem, [0])
        with pytest.raises(ValueError):
            t.post("READ", rem, [0], loc, [0])  # sides swapped
        with pytest.raises(ValueError):
            t.post("READ", loc, [0, 1], rem, [0])
        with pytest.raises(IndexError, match=r"local_idx out of range: values in \[4, 4\] for a list of 4"):
            t.post("READ", loc, [4], rem, [0])
        with pytest.raises(IndexError, match=r"remote_idx out of range: values in \[-1, 0\]"):
            t.post("READ", loc, [0, 1], rem, [0, -1])
        with pytest.raises(IndexError, match="remote_idx"):
            t.post("READ", loc, [0], rem, np.array([1 << 40]))
        with pytest.raises(TypeError):
            t.post("READ", loc, [0.0], rem, [0])
        with pytest.raises(TransportError, match="add_remote"):
            t.send_notif("nobody", b"x")

        x = t.post("READ", loc, [0, 1, 2, 3], rem, [3, 2, 1, 0], notif=b"self")
        assert _wait(t, x) is XferStatus.DONE
        for i in range(4):
            assert torch.equal(b[i * 1024:(i + 1) * 1024], a[(3 - i) * 1024:(4 - i) * 1024])
        t.release(x)
        deadline = time.monotonic() + REPLY_S
        inbox: dict = {}
        while not inbox and time.monotonic() < deadline:
            inbox = t.poll_notifs()
        assert inbox == {t.name: [b"self"]}

        t.release_list(loc)
        with pytest.raises(ValueError, match="released"):
            t.post("READ", loc, [0], rem, [0])
        t.deregister(reg)
        t.deregister(reg)
    assert t.closed
    t.close()  # idempotent
    with pytest.raises(TransportError, match="closed"):
        t.poll_notifs()
