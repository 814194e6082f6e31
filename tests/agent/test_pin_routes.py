"""Issue 33, finding 2: an engine's pin is its authenticated identity; an address is only a route
to it, over real sockets on 127.0.0.0/8 and real NIXL. A forged first request that names the real
prefill's engine id at a TCP relay (which forwards bytes to the real prefill) no longer locks the
honest address out: a request naming the real address meets the engine again there, where it
proves itself, and loads byte-exact. An address that answers without the credential is refused
before any connection for a while, and never becomes a route."""

import secrets

import pytest
from helpers.connector_bed import Bed
from helpers.handshake import RogueListener  # a listener without the secret

from kvtriton.testing.relay import ByteRelay

pytestmark = pytest.mark.nixl


@pytest.fixture
def bed(gen, tmp_path):
    f = tmp_path / "secret"
    f.write_bytes(secrets.token_hex(32).encode())
    f.chmod(0o600)
    b = Bed(gen, p_extra={"auth_secret_file": str(f)}, d_extra={"auth_secret_file": str(f)})
    yield b
    b.close()


def test_a_relayed_first_meeting_does_not_lock_the_real_address_out(bed):
    # before: the relayed meeting pinned P to the relay's address, and every honest load naming
    # the real address was refused ("was met at 127.0.0.2:...") until the decode restarted
    with ByteRelay("127.0.0.1", bed.port, host="127.0.0.2") as relay:
        bed.hold("r1", [1, 2])
        assert bed.load("r1", [1, 2], [3, 4], host="127.0.0.2", port=relay.port) == (True, set())
        bed.assert_landed([1, 2], [3, 4])  # the bytes move over NIXL, from the real prefill
        assert relay.connections == 1
        for i, (remote, local) in enumerate((([5, 6], [7, 8]), ([9], [10]), ([11, 12], [13, 14]))):
            bed.hold(f"h{i}", remote)
            assert bed.load(f"h{i}", remote, local) == (True, set()), i
            bed.assert_landed(remote, local)
        # the relay stays a route too (the engine proved itself through it): no new meeting there
        bed.hold("r2", [15])
        assert bed.load("r2", [15], [1], host="127.0.0.2", port=relay.port) == (True, set())
        bed.assert_landed([15], [1])
        assert relay.connections == 1


def test_an_address_that_cannot_prove_the_engine_is_no_route_and_is_not_dialled_again(bed):
    bed.hold("r1", [1, 2])
    assert bed.load("r1", [1, 2], [3, 4]) == (True, set())
    rogue = RogueListener("127.0.0.3")
    try:
        for i in range(3):
            bed.hold(f"f{i}", [5, 6])
            done, errors = bed.load(f"f{i}", [5, 6], [7, 8], host="127.0.0.3", port=rogue.port)
            assert done and errors == {7, 8}  # recomputed
        assert rogue.connections == 1 and b"agent" not in rogue.received  # dialled once: it failed to prove P
    finally:
        rogue.close()
    bed.hold("r2", [9, 10])
    assert bed.load("r2", [9, 10], [11, 12]) == (True, set())  # the real address still works
    bed.assert_landed([9, 10], [11, 12])
