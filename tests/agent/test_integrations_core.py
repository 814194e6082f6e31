"""The integrations' shared core: settings, the agent they make, the meeting of a prefill engine.

Both engines build their agent with :func:`~kvtriton.integrations.core.make_agent` and meet prefill
engines with :class:`~kvtriton.integrations.core.Meetings`; here without an engine: real agents on
CPU tensors, each prefill rank's metadata served on a port of its own.
"""

import ast
import pathlib
import threading
import time

import pytest
import torch

from kvtriton.errors import PeerRefusedError, ProtocolError, RequestRejectedError
from kvtriton.integrations.core import Meetings, PrefillEngine, RankAddress, make_agent, serve_metadata
from kvtriton.integrations.settings import SettingsError, TransferSettings
from kvtriton.integrations.sglang.settings import ENV, BackendSettings
from kvtriton.integrations.vllm.settings import from_extra_config
from kvtriton.plan import CostModel, meeting_ranks
from kvtriton.protocol import wire
from kvtriton.protocol.allowlist import PeerAllowlist
from kvtriton.protocol.auth import Credential
from kvtriton.regions import Region
from kvtriton.transport.nixl import NixlTransport

BLOCKS, BS, DIM, HEADS = 8, 4, 16, 6
SMALL = {"staging_bytes": 1 << 20, "slot_bytes": 4096, "handshake_timeout_s": 1.0, "handshake_attempts": 1}
INTEGRATIONS = pathlib.Path(__file__).resolve().parents[2] / "kvtriton" / "integrations"


def _regions(tp: int, heads: int = HEADS) -> list[Region]:
    k = torch.zeros(BLOCKS, max(1, heads // tp), BS, DIM)  # fewer heads than ranks: each is replicated
    return [Region.attention("l0", k, layout="HND", block_size=BS, total_heads=heads)]


def _calls(path: pathlib.Path, name: str) -> int:
    return sum(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == name
               for n in ast.walk(ast.parse(path.read_text())))


# ----------------------------------------------------------------------------- settings

def test_both_engines_read_the_same_settings_and_name_their_source_in_errors():
    values = {"timeout_s": 7, "replicate_stripe": 0, "cost_model": "desc_us=1.8,pass_us=90", "modes": "staged"}
    vllm = from_extra_config(values)
    sglang = BackendSettings.from_mapping(values).agent
    assert type(sglang) is TransferSettings and isinstance(vllm, TransferSettings)
    assert {f: getattr(vllm, f) for f in values} == {f: getattr(sglang, f) for f in values}
    assert vllm.timeout_s == 7.0 and vllm.agent_stripe is None
    with pytest.raises(SettingsError, match=r"^kv_connector_extra_config\['timeout_s'\]"):
        from_extra_config({"timeout_s": 0})
    with pytest.raises(SettingsError, match=rf"^{ENV}\['timeout_s'\]"):
        BackendSettings.from_mapping({"timeout_s": 0})
    with pytest.raises(SettingsError, match=r"^settings: unknown keys \['nope'\]"):
        TransferSettings.from_mapping({"nope": 1})


def test_the_sglang_backend_does_not_import_the_vllm_package():
    sources = [p.read_text() for p in (INTEGRATIONS / "sglang").glob("*.py")]
    assert not [s for s in sources if "..vllm" in s or "integrations.vllm" in s]


# ----------------------------------------------------------------------------- make_agent

def test_one_agent_construction_in_the_integrations():
    made = {p.relative_to(INTEGRATIONS).as_posix(): _calls(p, "TransferAgent") for p in INTEGRATIONS.rglob("*.py")}
    assert {p: n for p, n in made.items() if n} == {"core.py": 1}
    assert _calls(INTEGRATIONS / "vllm" / "worker.py", "make_agent") == 1
    assert _calls(INTEGRATIONS / "sglang" / "conn.py", "make_agent") == 1


@pytest.mark.nixl
@pytest.mark.parametrize("stripe", [0, 1])
def test_sglang_settings_reach_the_agent_replicate_stripe_and_cost_model(stripe):
    """What SGLang's settings set is what the agent plans with and tells its peers: the stripe
    among the settings both engines must share, the pinned cost model in its metadata."""
    settings = BackendSettings.from_mapping({**SMALL, "replicate_stripe": stripe,
                                             "cost_model": "desc_us=1.8,pass_us=90"}).agent
    agent = make_agent(settings, "sglang-decode@h:1", 0, 1, _regions(1), None)
    try:
        md = wire.decode_metadata(agent.metadata())
        assert dict(md.planning)["replicate_stripe"] == repr(stripe or None)
        assert md.cost is not None and (md.cost.desc_us, md.cost.pass_us) == (1.8, 90.0)
        assert md.cost.read_gbps == CostModel().read_gbps  # the fields not named keep their defaults
    finally:
        agent.close()


@pytest.mark.nixl
def test_the_default_cost_model_is_the_default_one():
    agent = make_agent(TransferSettings.from_mapping(SMALL), "e", 0, 1, _regions(1), None)
    try:
        md = wire.decode_metadata(agent.metadata())
        assert md.cost is not None and md.cost.as_dict() == CostModel().as_dict()
        assert dict(md.planning)["replicate_stripe"] == "1"  # one replica: the shared default
    finally:
        agent.close()


# ----------------------------------------------------------------------------- Meetings

class Cluster:
    """A prefill engine of ``p_tp`` ranks (each serving its metadata on a port of its own) and
    decode rank ``d_rank`` of ``d_tp`` meeting it."""

    def __init__(self, p_tp: int, d_tp: int, d_rank: int = 0, *, heads: int = HEADS, engine: str = "P",
                 max_meetings=None, allowed=None, credential=None):
        settings = TransferSettings.from_mapping(SMALL)
        self.prefill = [make_agent(settings, engine, r, p_tp, _regions(p_tp, heads), credential) for r in range(p_tp)]
        self.servers = [serve_metadata(a, credential, "127.0.0.1", 0, io_timeout_s=1.0) for a in self.prefill]
        self.decode = make_agent(settings, "D", d_rank, d_tp, _regions(d_tp, heads), credential)
        self.located: list[int] = []
        self.met, self.failed = [], []
        self.ended = threading.Event()
        self.gate = threading.Event()
        self.gate.set()
        self.meetings = Meetings(self.decode, settings, credential, locate=self._locate, on_met=self._met,
                                 on_failed=self._failed, threads=2, max_meetings=max_meetings, allowed=allowed)

    def _locate(self, target: PrefillEngine, rank: int) -> RankAddress:
        self.gate.wait(10)
        self.located.append(rank)
        return RankAddress("127.0.0.1", self.servers[rank].port, row=f"zmq-{rank}")

    def _met(self, meeting, parked):
        self.met.append((meeting, parked))
        self.ended.set()

    def _failed(self, meeting, parked, error):
        self.failed.append((meeting, parked, error))
        self.ended.set()

    def target(self, engine_id="P", port=1) -> PrefillEngine:
        return PrefillEngine(engine_id, "127.0.0.1", port, len(self.prefill))

    def wait(self):
        assert self.ended.wait(20)
        self.ended.clear()

    def close(self):
        self.meetings.close()
        for s in self.servers:
            s.close()
        for a in [*self.prefill, self.decode]:
            a.close()


@pytest.fixture
def cluster():
    made = []

    def make(*args, **kw):
        made.append(Cluster(*args, **kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.mark.nixl
def test_a_decode_rank_meets_only_the_ranks_the_planner_names_and_parks_requests_until_then(cluster):
    c = cluster(2, 3, d_rank=0)  # P2 -> D3: decode rank 0 reads prefill rank 0 only, and owes rank 1 no done
    assert meeting_ranks(0, 3, c.decode.specs, 2) == (0,)
    target = c.target()
    assert c.meetings.refusal(target) is None
    assert c.meetings.join(target, "r1", "load-1") is None
    assert c.meetings.join(target, "r2", "load-2") is None
    c.wait()
    (meeting, parked), = c.met
    assert parked == ["load-1", "load-2"] and c.located == [0]
    assert (meeting.engine, meeting.ranks, meeting.reads, meeting.rows) == ("P", (0,), (0,), {0: "zmq-0"})
    assert c.meetings.join(target, "r3", "load-3") is meeting and c.meetings.met(target.key) is meeting
    c.meetings.forget(target.key)
    assert c.meetings.met(target.key) is None


@pytest.mark.nixl
@pytest.mark.parametrize("p_tp, d_tp, d_rank, heads, ranks, reads", [
    (2, 1, 0, 6, (0, 1), (0, 1)),  # the decode reads both halves
    (4, 2, 0, 2, (0,), (0,)),  # 2 heads over P4: rank 0 reads head 0 from prefill rank 0 and owes no done
    (4, 2, 1, 2, (1, 2, 3), (2,)),  # rank 1 reads head 1 from rank 2, and tells 1 and 3 (read by none)
])
def test_a_rank_no_decode_rank_reads_is_met_by_the_one_that_owes_its_done(cluster, p_tp, d_tp, d_rank, heads,
                                                                          ranks, reads):
    c = cluster(p_tp, d_tp, d_rank, heads=heads)
    assert c.meetings.join(c.target(), "r", "load") is None
    c.wait()
    (meeting, _), = c.met
    assert (meeting.ranks, meeting.reads) == (ranks, reads) and tuple(sorted(c.located)) == ranks
    assert {p["rank"] for p in c.decode.debug_state()["peers"].values()} == set(ranks)


@pytest.mark.nixl
def test_an_engine_answering_with_another_identity_fails_its_parked_requests(cluster):
    c = cluster(1, 1, engine="impostor")
    assert c.meetings.join(c.target("P"), "r", "load") is None
    c.wait()
    (_, parked, error), = c.failed
    assert parked == ["load"] and isinstance(error, ProtocolError) and "'impostor'" in str(error)
    assert c.meetings.met(c.target("P").key) is None  # forgotten: the next request meets it again
    assert c.meetings.join(c.target("P"), "r2", "load-2") is None
    c.wait()
    assert len(c.failed) == 2


@pytest.mark.nixl
def test_an_unknown_engine_id_is_taken_from_its_first_rank(cluster):
    c = cluster(2, 1, engine="sglang-prefill@x")
    target = PrefillEngine(None, "127.0.0.1", 9, 2)  # SGLang: the bootstrap address alone
    assert c.meetings.join(target, 7, 7) is None
    c.wait()
    assert c.met[0][0].engine == "sglang-prefill@x"


@pytest.mark.nixl
def test_refusals_before_any_connection(cluster):
    c = cluster(1, 1, max_meetings=1, allowed=PeerAllowlist(["engine:P"]))
    assert isinstance(c.meetings.refusal(c.target("Q")), RequestRejectedError)  # not in allowed_peers
    c.gate.clear()  # the first meeting hangs in locate
    assert c.meetings.join(c.target("P", port=1), "a", "a") is None
    refused = c.meetings.refusal(c.target("P", port=2))
    assert isinstance(refused, RequestRejectedError) and "1 handshakes are in flight" in str(refused)
    assert c.meetings.refusal(c.target("P", port=1)) is None  # the meeting in flight takes more requests
    assert c.meetings.unpark("a") == "a" and c.meetings.unpark("a") is None
    c.gate.set()
    c.wait()
    assert c.met[0][1] == []


@pytest.mark.nixl
def test_an_authenticated_engine_named_at_a_new_address_is_met_again_there(cluster):
    # issue 33, finding 2: an address is a route, not the pin: the engine proves itself there
    # (before: refused for good, "was met at 127.0.0.1:1")
    c = cluster(1, 1, credential=Credential(secret=b"s" * 32))
    assert c.meetings.join(c.target("P", port=1), "a", "a") is None
    c.wait()
    assert c.met
    assert c.meetings.refusal(c.target("P", port=2)) is None
    assert c.meetings.join(c.target("P", port=2), "b", "b") is None
    c.wait()
    (_, parked), = c.met[1:]
    assert parked == ["b"] and not c.failed
    assert [p["agent"] for p in c.decode.debug_state()["peers"].values()] == [c.prefill[0].transport.name]


@pytest.mark.nixl
def test_a_credentialed_meeting_seals_the_pair_s_messages(cluster):
    # issue 33, finding 3: serve_metadata and Meetings hand the meeting's pair keys to add_remote
    # on both sides, so a message under the prefill's agent name from another agent is refused
    c = cluster(1, 1, credential=Credential(secret=b"s" * 32))
    assert c.meetings.join(c.target(), "a", "a") is None
    c.wait()
    (meeting, _), = c.met
    p, d = c.prefill[0], c.decode
    assert meeting.agents == {0: p.transport.name}
    forger = NixlTransport(p.transport.name)
    try:
        forger.add_remote(wire.decode_metadata(d.metadata()).agent_md)
        forger.send_notif(d.transport.name, wire.Pong(7).encode())
        end = time.monotonic() + 5
        while d.stats["bad_messages"] == 0 and time.monotonic() < end:
            forger.poll_notifs()
            d.progress()
    finally:
        forger.close()
    assert d.stats["forged_messages"] == 1


@pytest.mark.nixl
def test_a_new_address_never_replaces_the_engine_s_agent_even_a_silent_one(cluster):
    # issue 33, finding 2: a member with the secret serving "P" at an address a request names
    # cannot take over the P it met elsewhere, though that P is silent (its progress never runs
    # here, so a liveness check goes unanswered); before: replaced after the check
    cred = Credential(secret=b"s" * 32)
    c, imp = cluster(1, 1, credential=cred), cluster(1, 1, credential=cred)
    c.meetings.locate = lambda target, rank: RankAddress(
        "127.0.0.1", (c if target.port == 1 else imp).servers[rank].port)
    assert c.meetings.join(c.target("P", port=1), "a", "a") is None
    c.wait()
    real = c.prefill[0].transport.name
    assert c.meetings.join(c.target("P", port=2), "b", "b") is None
    c.wait()
    (_, parked, error), = c.failed
    assert parked == ["b"] and isinstance(error, PeerRefusedError), error
    assert [p["agent"] for p in c.decode.debug_state()["peers"].values()] == [real]
    assert c.meetings.join(c.target("P", port=1), "c", "c") is not None  # the real route still met
