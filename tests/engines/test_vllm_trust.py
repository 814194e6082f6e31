"""Forged ``kv_transfer_params`` against real vLLM engines (issue 18; the test bed, nothing mocked).

Both engines share a cluster secret; the decode allows peers on 127.0.0.1 only. A forged request
names the real prefill engine id at a rogue listener's address (a listener without the secret);
another names an address outside ``allowed_peers``. Oracles: every decode's greedy tokens equal the
same engine computing the prompt itself; the rogue never received a byte of the decode's metadata
and the disallowed address never saw a connection; and the honest loads that follow read their KV
from the prefill (at most one prompt token computed per request), so nothing was poisoned.
"""

import secrets

import pytest
from helpers.handshake import HELLO, RogueListener, frames_of  # a listener without the secret
from helpers.vllm_bed_python import vllm_bed_python
from helpers.vllm_engines import Pair  # the model_dir and prompts fixtures: conftest.py

from kvtriton.protocol.auth import NONCE_BYTES

pytestmark = pytest.mark.vllm
vllm_bed_python()  # this module is skipped where the bed is missing (an error in CI)


def test_forged_params_are_computed_locally_and_do_not_poison_later_loads(model_dir, tmp_path, prompts):
    secret = tmp_path / "secret"
    secret.write_bytes(secrets.token_hex(32).encode())
    secret.chmod(0o600)
    rogue, outside = RogueListener("127.0.0.1"), RogueListener("127.0.0.2")
    pair = Pair(model_dir, tmp_path, 1, 1, p_extra={"auth_secret_file": str(secret)},
                d_extra={"auth_secret_file": str(secret), "allowed_peers": ["127.0.0.1"]})
    try:
        ref = pair.reference(prompts, tag="ref")
        params = pair.prefill_requests(prompts, "p")
        # 1. the first request naming the prefill's engine id points at the rogue
        forged = [{**kp, "remote_port": rogue.port} for kp in params[:2]]
        out = pair.decode_requests(prompts[:2], forged, "forged")
        assert [o["tokens"] for o in out] == ref[:2]
        assert rogue.connections >= 1 and b"decode-tp1" not in rogue.received and b"agent" not in rogue.received
        # HELLO frames (a nonce) and the fixed mismatch notice, nothing else: a frame-by-frame read
        # (a notice may come after the rogue stopped listening on a starved host: that is no leak)
        kinds = frames_of(bytes(rogue.received))
        notice = b"credential mismatch: the server's proof does not verify under our secret"
        assert kinds and kinds[0][0] == HELLO, kinds
        assert all((k == HELLO and len(p) == NONCE_BYTES) or p == notice for k, p in kinds), kinds
        # 2. an address outside allowed_peers: computed locally, never connected to
        out = pair.decode_requests(prompts[2:3], [{**params[2], "remote_host": "127.0.0.2",
                                                   "remote_port": outside.port}], "outside")
        assert [o["tokens"] for o in out] == ref[2:3]
        assert [o["prompt_computed"] for o in out] == [len(prompts[2])]
        assert outside.connections == 0
        # 3. honest loads after both: the prefill's KV, byte-exact (tokens identical, nothing recomputed)
        out = pair.decode_requests(prompts, params, "honest")
        assert [o["tokens"] for o in out] == ref
        assert all(o["prompt_computed"] <= 1 for o in out), [o["prompt_computed"] for o in out]
        # 4. the rogue answered without the credential: it is not even dialled again (for 5 minutes)
        seen = rogue.connections
        params2 = pair.prefill_requests(prompts[:1], "p2")
        out = pair.decode_requests(prompts[:1], [{**params2[0], "remote_port": rogue.port}], "forged2")
        assert [o["tokens"] for o in out] == ref[:1] and rogue.connections == seen
        pair.settle(pair.decode)
    finally:
        pair.close()
        rogue.close()
        outside.close()
    assert outside.connections == 0
