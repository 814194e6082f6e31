"""The TCP side channel that carries handshake metadata (kvtriton.protocol.handshake), on 127.0.0.1."""

import socket
import struct
import threading
import time

import pytest
import torch

from kvtriton.errors import IncompatibleRemoteError, PeerDisconnectedError, ProtocolError, RequestRejectedError
from kvtriton.protocol.handshake import MAX_FRAME_BYTES, VERSION, MetadataServer, exchange_metadata


class Recorder:
    def __init__(self, refuse: str | None = None):
        self.got, self.refuse = [], refuse

    def __call__(self, payload: bytes):
        if self.refuse:
            raise IncompatibleRemoteError(self.refuse)
        self.got.append(payload)


def test_round_trip_carries_both_sides_metadata():
    rec = Recorder()
    with MetadataServer("127.0.0.1", 0, lambda: b"server-md" * 1000, rec) as srv:
        got = exchange_metadata("127.0.0.1", srv.port, b"client-md", timeout_s=2)
    assert got == b"server-md" * 1000 and rec.got == [b"client-md"]
    assert srv.stats["served"] == 1


def test_a_refusal_reaches_the_caller_with_its_reason():
    with MetadataServer("127.0.0.1", 0, lambda: b"md", Recorder(refuse="region 3: dtype differs")) as srv:
        with pytest.raises(RequestRejectedError, match="dtype differs"):
            exchange_metadata("127.0.0.1", srv.port, b"client-md", timeout_s=2)
    assert srv.stats["refused"] == 1


def test_no_server_fails_after_bounded_attempts():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    t0 = time.monotonic()
    with pytest.raises(PeerDisconnectedError, match="after 3 attempts"):
        exchange_metadata("127.0.0.1", port, b"md", timeout_s=0.5, attempts=3, backoff_s=0.05)
    assert time.monotonic() - t0 < 3


def test_silent_server_times_out():
    lsock = socket.create_server(("127.0.0.1", 0))  # accepts (backlog) but never answers
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerDisconnectedError):
            exchange_metadata("127.0.0.1", lsock.getsockname()[1], b"md", timeout_s=0.3, attempts=2, backoff_s=0.01)
        assert time.monotonic() - t0 < 3
    finally:
        lsock.close()


def test_slow_and_malformed_clients_cost_only_their_own_connections():
    rec = Recorder()
    with MetadataServer("127.0.0.1", 0, lambda: b"md", rec, io_timeout_s=0.5, max_connections=2) as srv:
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(2)]  # send nothing
        time.sleep(0.1)
        # silent connections never take a worker slot: an honest client gets through at once
        t0 = time.monotonic()
        assert exchange_metadata("127.0.0.1", srv.port, b"honest", timeout_s=1, attempts=1) == b"md"
        assert time.monotonic() - t0 < 1
        for bad in (b"GET / HTTP/1.1\r\n\r\n",  # not our magic
                    struct.pack(">4sBBI", b"KVTH", VERSION, 1, MAX_FRAME_BYTES + 1),  # oversized: refused unread
                    struct.pack(">4sBBI", b"KVTH", VERSION, 9, 3) + b"abc",  # wrong frame kind
                    struct.pack(">4sBBI", b"KVTH", VERSION, 1, 100) + b"short"):  # truncated, then silence
            with socket.create_connection(("127.0.0.1", srv.port)) as c:
                c.sendall(bad)
                c.settimeout(2)
                try:
                    assert c.recv(16) == b""  # closed without an answer
                except ConnectionResetError:  # closed with our bytes unread: also no answer
                    pass
        assert exchange_metadata("127.0.0.1", srv.port, b"after", timeout_s=1) == b"md"
        for c in idle:
            c.close()
    assert rec.got == [b"honest", b"after"]
    # the idle ones were dropped at the first-bytes deadline, the malformed ones failed
    assert srv.stats["turned_away"] == 2 and srv.stats["failed"] == 4


def test_a_reply_that_is_not_a_frame_is_a_protocol_error():
    lsock = socket.create_server(("127.0.0.1", 0))

    def answer():
        conn, _ = lsock.accept()
        with conn:
            conn.recv(1 << 16)
            conn.sendall(struct.pack(">4sBBI", b"KVTH", VERSION, 7, 0))

    th = threading.Thread(target=answer, daemon=True)
    th.start()
    try:
        with pytest.raises(ProtocolError, match="frame kind 7"):
            exchange_metadata("127.0.0.1", lsock.getsockname()[1], b"md", timeout_s=2, attempts=1)
    finally:
        th.join(2)
        lsock.close()


@pytest.mark.nixl
def test_agents_meet_over_the_side_channel_and_transfer(gen):
    pytest.importorskip("nixl")
    from kvtriton import Region
    from kvtriton.agent import TransferAgent

    def regions(heads):
        k = torch.randn(16, heads, 4, 32, generator=gen)
        return [Region.attention("l0", k, layout="HND", block_size=4, total_heads=2)]

    p_regions, d_regions = regions(2), regions(1)
    d_regions[0].streams[0].zero_()
    with TransferAgent("P", 0, 1, p_regions, staging_bytes=1 << 20, slot_bytes=4096) as p, \
            TransferAgent("D", 1, 2, d_regions, staging_bytes=1 << 20, slot_bytes=4096) as d, \
            MetadataServer("127.0.0.1", 0, p.metadata, p.add_remote) as srv:
        p.start()
        assert d.add_remote(exchange_metadata("127.0.0.1", srv.port, d.metadata(), timeout_s=5)) == "P"
        p.hold("r", [3, 7])
        d.fetch("r", "P", [3, 7], [0, 5])
        deadline = time.monotonic() + 10
        while not (res := d.results()):
            assert time.monotonic() < deadline
            d.progress()
        assert res[0].ok, res
        src, dst = p_regions[0].streams[0], d_regions[0].streams[0]
        for s, t in ((3, 0), (7, 5)):  # D rank 1 of 2 holds global head 1
            assert torch.equal(dst[t].view(torch.uint8), src[s, 1:2].view(torch.uint8))
