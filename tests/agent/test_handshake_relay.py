"""Issue 33, finding 1: a TCP relay that only forwards bytes between two members of the cluster
(the address a forged ``kv_transfer_params`` names) learns nothing it can use from the shared
secret's handshake. The two ranks meet through it over real sockets and real NIXL; the relay's
recorded streams then hold neither rank's NIXL metadata, in any frame."""

import secrets
import time

import pytest
import torch

from kvtriton.protocol import wire
from kvtriton.protocol.auth import Credential
from kvtriton.protocol.handshake import MetadataServer, exchange_metadata
from kvtriton.testing.relay import ByteRelay


def marker() -> bytes:
    return b"MD-" + secrets.token_hex(16).encode()


def decodable_metadata(relay: ByteRelay) -> list[wire.RankMetadata]:
    """Every frame payload (whole, or after a 32-byte proof) that decodes as a rank's metadata:
    what the relay could load into a NIXL agent of its own."""
    found = []
    for stream in (relay.to_server, relay.to_client):
        for _kind, payload in ByteRelay.frames(bytes(stream)):
            for skip in (0, 32):
                try:
                    found.append(wire.decode_metadata(payload[skip:]))
                except Exception:  # noqa: BLE001 - anything that does not decode is what we want
                    pass
    return found


def test_relay_sees_no_metadata_bytes():
    cred = Credential(secret=secrets.token_bytes(32))
    smd, cmd = marker() * 50, marker() * 50
    got = []
    with MetadataServer("127.0.0.1", 0, lambda: smd, got.append, credential=cred) as srv, \
            ByteRelay("127.0.0.1", srv.port) as relay:
        # the relay forwards honestly, so the members still meet through it
        assert exchange_metadata("127.0.0.1", relay.port, cmd, credential=cred, timeout_s=3) == smd
    assert got == [cmd] and relay.connections == 1
    seen = bytes(relay.to_server) + bytes(relay.to_client)
    assert len(ByteRelay.frames(bytes(relay.to_client))) == 2  # it parsed the frames ...
    assert smd[:35] not in seen and cmd[:35] not in seen  # ... and holds neither metadata


@pytest.mark.nixl
def test_relay_between_real_agents_cannot_load_their_metadata(gen):
    pytest.importorskip("nixl")
    from kvtriton import Region
    from kvtriton.agent import TransferAgent

    def regions(heads):
        k = torch.randn(16, heads, 4, 32, generator=gen)
        return [Region.attention("l0", k, layout="HND", block_size=4, total_heads=2)]

    cred = Credential(secret=secrets.token_bytes(32))
    p_regions, d_regions = regions(2), regions(1)
    d_regions[0].streams[0].zero_()
    with TransferAgent("P", 0, 1, p_regions, staging_bytes=1 << 20, slot_bytes=4096) as p, \
            TransferAgent("D", 1, 2, d_regions, staging_bytes=1 << 20, slot_bytes=4096) as d, \
            MetadataServer("127.0.0.1", 0, p.metadata, p.add_remote, credential=cred) as srv, \
            ByteRelay("127.0.0.1", srv.port) as relay:
        p.start()
        assert d.add_remote(exchange_metadata("127.0.0.1", relay.port, d.metadata(), credential=cred,
                                              timeout_s=5)) == "P"
        # the meeting through the relay is a real one: a fetch moves the bytes
        p.hold("r", [3, 7])
        d.fetch("r", "P", [3, 7], [0, 5])
        deadline = time.monotonic() + 10
        while not (res := d.results()):
            assert time.monotonic() < deadline
            d.progress()
        assert res[0].ok, res
    seen = bytes(relay.to_server) + bytes(relay.to_client)
    assert len(seen) > 0
    for md in (wire.decode_metadata(p.metadata()), wire.decode_metadata(d.metadata())):
        assert md.agent_md not in seen  # the NIXL blob: UCX worker address and remote keys
        assert md.agent_md[:64] not in seen
    assert decodable_metadata(relay) == []


def test_each_meeting_derives_its_own_pair_keys():
    """Both sides of one meeting hold the same pair keys, swapped (send = the other's recv), each
    direction its own key; another meeting derives others; TLS-less plain meetings have none."""
    from kvtriton.protocol.handshake import meet

    cred = Credential(secret=secrets.token_bytes(32))
    meetings = []
    with MetadataServer("127.0.0.1", 0, lambda: b"server-md", on_meeting=meetings.append, credential=cred) as srv:
        first = meet("127.0.0.1", srv.port, b"client-md", credential=cred, timeout_s=3)
        second = meet("127.0.0.1", srv.port, b"client-md", credential=cred, timeout_s=3)
    assert first.metadata == b"server-md" and [m.metadata for m in meetings] == [b"client-md"] * 2
    for mine, theirs in ((first, meetings[0]), (second, meetings[1])):
        assert mine.keys is not None and theirs.keys is not None
        assert mine.keys.send == theirs.keys.recv and mine.keys.recv == theirs.keys.send
        assert mine.keys.send != mine.keys.recv and len(mine.keys.send) == 32
        assert mine.keys.send.hex() not in repr(mine.keys)
    assert first.keys.send != second.keys.send
    with MetadataServer("127.0.0.1", 0, lambda: b"md", on_meeting=meetings.append) as plain:
        assert meet("127.0.0.1", plain.port, b"c", timeout_s=3).keys is None


def test_a_relay_that_changes_a_sealed_byte_is_refused():
    """The relay flips one bit of the sealed client metadata: the server refuses, generically,
    and its gate never sees the changed metadata."""
    import socket
    import struct
    import threading

    from kvtriton.errors import AuthenticationError

    cred = Credential(secret=secrets.token_bytes(32))
    got = []
    header = struct.Struct(">4sBBI")
    with MetadataServer("127.0.0.1", 0, lambda: b"server-md", got.append, credential=cred) as srv:
        lsock = socket.create_server(("127.0.0.1", 0))

        def tamper():
            client, _ = lsock.accept()
            with client, socket.create_connection(("127.0.0.1", srv.port)) as server:
                client.settimeout(3)
                server.settimeout(3)
                server.sendall(client.recv(header.size + 32, socket.MSG_WAITALL))  # HELLO
                challenge = server.recv(header.size + 64, socket.MSG_WAITALL)
                client.sendall(challenge)
                head = client.recv(header.size, socket.MSG_WAITALL)
                body = bytearray(client.recv(header.unpack(head)[3], socket.MSG_WAITALL))
                body[-1] ^= 1
                server.sendall(head + bytes(body))
                client.sendall(server.recv(1 << 16))

        th = threading.Thread(target=tamper, daemon=True)
        th.start()
        with pytest.raises(AuthenticationError, match="did not accept our credential"):
            exchange_metadata("127.0.0.1", lsock.getsockname()[1], b"client-md", credential=cred, timeout_s=3,
                              attempts=1)
        th.join(3)
        lsock.close()
    assert got == [] and srv.stats["served"] == 0
