"""xPyD and DP through the vLLM connector's worker sides (issue 35, points 3 and 5), over real
NIXL and the real handshake, no vLLM engine: several prefill engines and decode engines as a
router pairs them. Every load is checked byte for byte against the prefill's random KV.

* A decode rank meets only the prefill ranks it reads (``meeting_ranks``).
* One prefill engine SIGKILLed fails only the loads that named it (recomputed, fast: its
  lifeline), the other engine's loads land exact.
* A prefill engine unused for ``forget_idle_s`` is forgotten on both sides (peer tables, NIXL
  state) and met again, exact, when a request names it; a used one is kept.
* ``decode_engine_id`` in a prefill's params packs its hold ahead for that decode engine with
  two decode engines connected (before: nothing packed); absent, or naming an engine not
  connected: nothing packed (lazy), the load still exact.
* DP: two TP2 prefill DP ranks on one host serve their handshakes on ports that do not
  collide and answer with their own engine ids; a decode loads from each the params name.
  (vLLM's CPU build refuses ``LLM(data_parallel_size=2)`` in one process; the DP engine ids
  and ports are checked with vLLM's own config classes in test_xpyd_dp_vllm_config.)
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from helpers import xpyd
from helpers.xpyd import drive, hold, landed, source, worker

from beds.vllm_bed import free_port_range
from kvtriton.integrations.vllm.dp import dp_settings
from kvtriton.integrations.vllm.settings import from_extra_config
from kvtriton.testing.child import ChildProcess

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl


@pytest.fixture
def made():
    out: list = []
    yield out
    for w in reversed(out):
        w.close()


def _peers(ws) -> set[str]:
    return set(ws.agent.debug_state()["peers"])


def _until(cond, seconds: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_decode_rank_meets_only_the_prefill_ranks_it_reads(made):
    port = free_port_range(2)
    p = [worker("P", {"port": port}, rank=r, tp=2, seed=5, serve=True)[0] for r in range(2)]
    made.extend(p)
    d, d_regs = worker("D", rank=1, tp=2)  # decode rank 1 of 2: the second head, prefill rank 1's
    made.append(d)
    for w in p:
        hold(w, "r", [3, 7])
    got = drive(d, {"q": (source("P", port, "r", [3, 7], tp=2), (0, 5))})
    assert got["q"][0] == set()
    src = xpyd.prefill_regions(5)[0].streams[0]
    assert torch.equal(d_regs[0].streams[0][[0, 5]], src[[3, 7], 1:2])
    assert _peers(d) == {"P:1"}  # not prefill rank 0: it holds no head decode rank 1 reads
    assert _peers(p[0]) == set() and _peers(p[1]) == {"D:1"}


def test_one_prefill_engine_killed_fails_only_its_loads(made):
    """2 prefill engines (child processes), one decode; P1 is SIGKILLed while both hold requests:
    the loads from P1 fail (recomputed) within a second and a half though ``timeout_s`` is 30,
    those from P2 land byte-exact, and the decode's staging is all free after."""
    ports = [free_port_range(1), free_port_range(1)]
    extra = {"timeout_s": 30.0}
    kids = [ChildProcess(xpyd.prefill_child, f"P{i + 1}", ports[i], 10 + i, extra, name=f"P{i + 1}")
            for i in range(2)]
    try:
        for k in kids:
            k.ready(timeout_s=180)
        d, d_regs = worker("D", extra)
        made.append(d)
        kids[0].call("hold", "a1", [1, 2])
        kids[1].call("hold", "a2", [1, 2])
        warm = drive(d, {"w1": (source("P1", ports[0], "a1", [1, 2]), (1, 2)),
                         "w2": (source("P2", ports[1], "a2", [1, 2]), (3, 4))}, seconds=60)
        assert warm["w1"][0] == set() and warm["w2"][0] == set()
        assert landed(d_regs, 10, [1, 2], [1, 2]) and landed(d_regs, 11, [1, 2], [3, 4])
        loads, y_local = {}, [(11, 12), (13, 14), (15, 0)]
        for j in range(3):
            kids[0].call("hold", f"b{j}", [4 + j, 8 + j])
            kids[1].call("hold", f"c{j}", [4 + j, 8 + j])
            loads[f"x{j}"] = (source("P1", ports[0], f"b{j}", [4 + j, 8 + j]), (5 + 2 * j, 6 + 2 * j))
            loads[f"y{j}"] = (source("P2", ports[1], f"c{j}", [4 + j, 8 + j]), y_local[j])
        kids[0].process.kill()
        kids[0].process.join(10)
        got = drive(d, loads, seconds=30)
        for j in range(3):
            assert got[f"x{j}"][0] == {5 + 2 * j, 6 + 2 * j}, got  # recomputed by vLLM
            assert got[f"x{j}"][1] < 1.5, got  # the lifeline, not the 30 s timeout
            assert got[f"y{j}"][0] == set(), got
            assert landed(d_regs, 11, [4 + j, 8 + j], y_local[j])
        assert "P1:0" not in _peers(d) and "P2:0" in _peers(d)
        _until(lambda: d.staging_in_use() == 0, what="staging not freed")
    finally:
        for k in kids:
            k.close()


@pytest.mark.parametrize("secret", [False, True], ids=["plain", "credential"])
def test_an_idle_prefill_engine_is_forgotten_on_both_sides_and_met_again(made, tmp_path, secret):
    extra = {}
    if secret:
        f = tmp_path / "secret"
        f.write_bytes(b"s" * 32)
        f.chmod(0o600)
        extra = {"auth_secret_file": str(f)}
    ports = [free_port_range(1), free_port_range(1)]
    p1, p1_regs = worker("P1", {"port": ports[0], **extra}, seed=21, serve=True)
    p2, _ = worker("P2", {"port": ports[1], **extra}, seed=22, serve=True)
    d, d_regs = worker("D", {"forget_idle_s": 0.5, **extra})
    made.extend([p1, p2, d])
    hold(p1, "a", [1])
    hold(p2, "b", [2])
    got = drive(d, {"qa": (source("P1", ports[0], "a", [1]), (1,)), "qb": (source("P2", ports[1], "b", [2]), (2,))})
    assert got["qa"][0] == got["qb"][0] == set()
    assert _peers(d) == {"P1:0", "P2:0"} and _peers(p1) == {"D:0"}
    time.sleep(0.7)  # P1 and P2 idle past forget_idle_s; a request for P2 uses it again
    hold(p2, "c", [3])
    assert drive(d, {"qc": (source("P2", ports[1], "c", [3]), (3,))})["qc"][0] == set()
    assert _peers(d) == {"P2:0"}, "the idle engine is dropped, the used one kept"
    _until(lambda: _peers(p1) == set(), what="the forgotten prefill never dropped the decode (lifeline)")
    assert _peers(p2) == {"D:0"}
    # met again on the next request naming it, on fresh random data, byte-exact
    p1_regs[0].streams[0].copy_(torch.randn(p1_regs[0].streams[0].shape, generator=torch.Generator().manual_seed(9)))
    hold(p1, "e", [4, 9])
    assert drive(d, {"qe": (source("P1", ports[0], "e", [4, 9]), (6, 7))})["qe"][0] == set()
    assert torch.equal(d_regs[0].streams[0][[6, 7]], p1_regs[0].streams[0][[4, 9]])
    assert _peers(d) == {"P1:0", "P2:0"} and _peers(p1) == {"D:0"}
    assert d.staging_in_use() == 0


def test_decode_engine_id_packs_ahead_for_the_named_decode_engine(made):
    port = free_port_range(1)
    staged = {"modes": "staged", "timeout_s": 8.0}  # staging read by a peer is quarantined this long after
    p, _ = worker("P", {"port": port, **staged}, seed=31, serve=True)
    d1, d1_regs = worker("D1", staged)
    d2, d2_regs = worker("D2", staged)
    made.extend([p, d1, d2])
    for i, d in enumerate((d1, d2)):  # both decode engines meet the prefill
        hold(p, f"m{i}", [0])
        assert drive(d, {"m": (source("P", port, f"m{i}", [0]), (0,))})["m"][0] == set()
    hold(p, "plain", [1, 2])  # no hint: two engines connected, nothing guessed (as before)
    hold(p, "elsewhere", [3, 4], pack_for="D9")  # an engine not connected: lazy
    hold(p, "named", [5, 6], pack_for="D2")
    _until(lambda: p.agent.packed_ahead("named") > 0, what="the named decode engine's hold was not packed ahead")
    assert p.agent.packed_ahead("plain") == 0 and p.agent.packed_ahead("elsewhere") == 0
    got = drive(d2, {"n": (source("P", port, "named", [5, 6]), (5, 6))})
    assert got["n"][0] == set() and landed(d2_regs, 31, [5, 6], [5, 6])
    got = drive(d1, {"x": (source("P", port, "plain", [1, 2]), (1, 2)),
                     "y": (source("P", port, "elsewhere", [3, 4]), (3, 4))})
    assert got["x"][0] == got["y"][0] == set()
    assert landed(d1_regs, 31, [1, 2, 3, 4], [1, 2, 3, 4])
    _until(lambda: p.staging_in_use() == 0, 30.0, what="prefill staging not freed")


def test_dp_ranks_serve_their_own_ports_and_ids_and_a_decode_loads_from_each(made):
    base = free_port_range(4)
    settings = from_extra_config({**xpyd.COMMON, "port": base})
    engines = []
    for dp in range(2):  # as vLLM gives each DP rank's connector: data_parallel_index = its DP rank
        s, engine = dp_settings(settings, "P", 2, SimpleNamespace(data_parallel_index=dp, data_parallel_size=2))
        engines.append((engine, s.port))
        for r in range(2):
            w, _ = worker(engine, {"port": s.port}, rank=r, tp=2, seed=40 + dp, serve=True)
            made.append(w)
            assert w.server is not None and w.server.port == base + 2 * dp + r
            hold(w, f"r{dp}", [2 + dp, 9])
    assert engines == [("P_dp0", base), ("P_dp1", base + 2)]
    d, d_regs = worker("D")
    made.append(d)
    got = drive(d, {f"q{dp}": (source(engine, port, f"r{dp}", [2 + dp, 9], tp=2), (1 + 2 * dp, 2 + 2 * dp))
                    for dp, (engine, port) in enumerate(engines)})
    assert all(e == set() for e, _ in got.values()), got
    assert landed(d_regs, 40, [2, 9], [1, 2]) and landed(d_regs, 41, [3, 9], [3, 4])
