"""Tier 2: kvtriton as the disaggregation transfer backend of real SGLang servers (CPU; the bed:
``make sglang-bed``; nothing of SGLang mocked or stubbed).

A prefill server and a decode server of different TP sizes run SGLang's own scheduler, pools and
bootstrap server with ``--disaggregation-transfer-backend kvtriton``; requests are posted as
SGLang's router posts them (:func:`beds.sglang_servers.pd_generate`). Oracles: the decode's
greedy tokens equal a non-disaggregated server's for prompts of several lengths that are not
multiples of the page size; every decode rank's receiver reached Success and the agents posted
descriptors for it (counted per request from their stats); a negative control (the prefill's
source pages scrambled just before they are sent, :mod:`beds.sglang_hooks`) changes
the tokens, so the KV the decode used really travelled, then turned off they match again.
"""

import os
import random

import pytest
from helpers.sglang_bed_python import bed_env, sglang_bed_python

from beds.sglang_servers import ServerProcess, engine_cpus, make_model, pd_generate

pytestmark = pytest.mark.sglang


SGL_PY = sglang_bed_python()
# this checkout first on the servers' PYTHONPATH, whichever checkout the bed's editable kvtriton names
ENV = {"PYTHONPATH": bed_env()["PYTHONPATH"]}
PAGE = 16
LENGTHS = (37, 100, 203)  # not multiples of the page size
MAX_TOKENS = 8
DESCRIPTOR_STATS = ("staged_descriptors", "direct_descriptors", "one_sided_descriptors")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(SGL_PY, tmp_path_factory.mktemp("sgl-llama") / "model")


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(20)
    return [[rng.randrange(1, 576) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(model_dir, prompts, tmp_path_factory):
    """Greedy tokens of one non-disaggregated TP1 server."""
    with ServerProcess.start(SGL_PY, model_dir, tp=1, page_size=PAGE, log_dir=tmp_path_factory.mktemp("plain"),
                             name="plain-tp1", env=ENV) as plain:
        return plain.generate(prompts, MAX_TOKENS)


class Pair:
    def __init__(self, model_dir, log_dir, p_tp, d_tp, backend="kvtriton"):
        self.p_tp, self.d_tp, self.rooms = p_tp, d_tp, iter(range(1000, 10**6))
        secret = log_dir / "secret"  # the handshakes authenticate, as a deployment's would
        secret.write_bytes(os.urandom(32))
        secret.chmod(0o600)  # a secret file others can read is refused
        self.env = {**ENV, "KVTRITON_AUTH_SECRET_FILE": str(secret)}
        # both start at once, each on its own cores: the pair is up in one server's start-up time
        self.prefill = ServerProcess.launch(SGL_PY, model_dir, tp=p_tp, mode="prefill", backend=backend,
                                            page_size=PAGE, cpus=engine_cpus(p_tp, 0), log_dir=log_dir,
                                            name="prefill", env=self.env)
        try:
            self.decode = ServerProcess.launch(SGL_PY, model_dir, tp=d_tp, mode="decode", backend=backend,
                                               page_size=PAGE, cpus=engine_cpus(d_tp, 1), log_dir=log_dir,
                                               name="decode", env=self.env)
        except BaseException:
            self.prefill.close()
            raise
        ServerProcess.wait_all_ready([self.prefill, self.decode])

    def descriptors(self) -> int:
        return sum(s.events.counters().get(k, 0) for s in (self.prefill, self.decode) for k in DESCRIPTOR_STATS)

    def run(self, prompts):
        """One request per prompt, in turn (descriptors per request from the stats' deltas)."""
        tokens, per_request = [], []
        for p in prompts:
            room = next(self.rooms)
            before = self.descriptors()
            out = pd_generate(self.prefill, self.decode, [p], MAX_TOKENS, [room])
            done = self.decode.events.by_room("recv_done").get(room, [])
            assert sorted(e["state"] for e in done) == ["success"] * self.d_tp, (room, done, self.decode.log_tail())
            tokens.append(out["tokens"][0])
            per_request.append(self.descriptors() - before)
        return tokens, per_request

    def close(self):
        ServerProcess.close_all([self.decode, self.prefill])


@pytest.fixture(scope="module", params=[(1, 2), (2, 1)], ids=["P1-D2", "P2-D1"])
def pair(request, model_dir, tmp_path_factory):
    p_tp, d_tp = request.param
    pair = Pair(model_dir, tmp_path_factory.mktemp(f"p{p_tp}d{d_tp}"), p_tp, d_tp)
    yield pair
    pair.close()


def test_tokens_match_a_plain_server(reference, prompts, pair):  # the plain server first, alone
    tokens, per_request = pair.run(prompts)
    assert tokens == reference, f"P{pair.p_tp}->D{pair.d_tp}: decode tokens {tokens} vs plain server {reference}"
    assert all(n > 0 for n in per_request), f"no descriptors posted for a request: {per_request}"
    print(f"P{pair.p_tp}->D{pair.d_tp} descriptors per request (lengths {LENGTHS}): {per_request}")


def test_scrambled_source_pages_change_tokens(reference, prompts, pair):
    pair.prefill.scramble("float32")
    try:
        tokens, _ = pair.run(prompts)
    finally:
        pair.prefill.scramble(None)
    sent = [e for es in pair.prefill.events.by_room("send").values() for e in es if e.get("scrambled")]
    assert sent, "the scramble hook never ran on the prefill"
    # the first token is the prefill's own (computed before the scramble); every later one is the decode's
    assert all(t[0] == r[0] for t, r in zip(tokens, reference)), (tokens, reference)
    assert all(t != r for t, r in zip(tokens, reference)), f"scrambled KV left tokens unchanged: {tokens}"
    again, _ = pair.run(prompts)
    assert again == reference, "after the control the servers no longer match the plain server"
