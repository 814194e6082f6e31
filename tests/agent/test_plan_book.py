"""A source plans a destination's transfers by the destination's cost model, everywhere.

With ``cost_model: "measured"`` the two hosts' models differ: the plan a source serves a peer by
is the one the peer built (with its own model; the protocol checks the digest), so the source's
warmup must compile that plan's packs, and its judgement of a hold (does this engine read from
me?) must look at that plan, never at one made with the source's own model.

Here the prefill's model finds a descriptor nearly free (it would read the one SPLIT region
DIRECT, zero-copy) while the decode's default model finds it dear (STAGED: pack, READ, unpack).
Real NIXL agents over UCX in one process, as in test_agent.py. The source's plans and warmed
kernels are read through ``debug_state()`` (its ``plans`` and ``warmed``), never its internals.
"""

import numpy as np
import pytest
import torch

from kvtriton.agent import TransferAgent
from kvtriton.ops import launch_config_for
from kvtriton.plan import CostModel, Route
from kvtriton.testing.oracle import (
    RegionModel,
    check_destination,
    load_source,
    make_global_kv,
    make_rank_regions,
    snapshot,
)

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl

MODELS = [RegionModel.gqa("l0", 4, 16)]  # a 4-token block of one stream: 512 bytes
CHEAP_DESCRIPTORS = CostModel(desc_us=0.01, source="test: descriptors nearly free")  # crossover 50 bytes
DEAR_DESCRIPTORS = CostModel(desc_us=100.0, source="test: descriptors dear")  # crossover 500 KB


def _source_plans(agent: TransferAgent) -> list[dict]:
    """Every plan the source side of ``agent`` keeps for its peers (``debug_state()["plans"]``:
    routes per region, digest)."""
    return agent.debug_state()["plans"]


STAGED = [Route.STAGED.value]  # a plan's routes in debug_state(): the one region STAGED


@pytest.fixture
def pair():
    gen = torch.Generator().manual_seed(7)
    P = make_rank_regions(MODELS, 0, 1, 32, 4, gen=gen)
    D = make_rank_regions(MODELS, 0, 1, 32, 4, gen=gen)
    kw = dict(staging_bytes=64 << 10, slot_bytes=1024, timeout_s=5.0)
    # the prefill warms up (under the interpreter: Triton kernels); the decode repacks with torch
    p = TransferAgent("P", 0, 1, P, cost=CHEAP_DESCRIPTORS, impl="auto", warmup=True, **kw)
    d = TransferAgent("D", 0, 1, D, cost=DEAR_DESCRIPTORS, impl="torch", **kw)
    d.add_remote(p.metadata())
    p.add_remote(d.metadata())
    yield p, d, P, D, gen
    p.close()
    d.close()


def _drive(p, d, until, seconds=30.0):
    import time

    got, end = [], time.monotonic() + seconds
    while time.monotonic() < end and not until(got):
        p.progress()
        d.progress()
        got += d.results()
    return got


def test_the_two_models_pick_different_routes():
    """The premise: for this region the prefill's own model and the decode's disagree."""
    from kvtriton.plan import build_plan

    specs = [r.spec for r in make_rank_regions(MODELS, 0, 1, 8, 4, gen=torch.Generator())]
    assert build_plan(0, 1, specs, 1, specs, cost=CHEAP_DESCRIPTORS).modes == (Route.DIRECT,)
    assert build_plan(0, 1, specs, 1, specs, cost=DEAR_DESCRIPTORS).modes == (Route.STAGED,)


def test_source_serves_by_the_destinations_model(pair):
    p, d, P, D, gen = pair
    assert d.plan_for("P").modes == (Route.STAGED,)  # the decode planned by its own (dear) model
    src, dst = np.array([3, 9, 4]), np.array([0, 5, 2])
    kv = make_global_kv(MODELS, src.size, 4, gen)
    load_source(P, 0, 1, kv, src)
    before = snapshot(D)
    p.hold("r", src, consumer="D")
    d.fetch("r", "P", src, dst)
    got = _drive(p, d, until=lambda got: got)
    assert got and got[0].ok, got  # the digests agreed: the source served the decode's plan
    check_destination(D, 0, 1, kv, dst, before)
    assert p.stats["staged_descriptors"] == 0 and d.stats["staged_descriptors"] > 0
    assert p.stats["direct_descriptors"] == 0 and d.stats["direct_descriptors"] == 0
    assert all(plan["routes"] == STAGED for plan in _source_plans(p))


def test_source_warmup_compiles_the_served_plans_packs(pair):
    """add_remote's warmup compiles the packs of the plan the source will serve (the decode's,
    STAGED), not of a plan made with the prefill's own model (DIRECT: nothing to pack)."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter path")
    p, d, *_ = pair
    served = d.plan_for("P").payload(0)
    assert served is not None
    for n in (1, 2, 3, 4):
        cfg = launch_config_for("pack", p.regions, served.segments, served.segment_offsets(n), np.arange(n),
                                p.pool.tensor)
        assert {"op": "pack", "config": cfg._asdict()} in p.debug_state()["warmed"], n


def test_hold_judgement_uses_the_destinations_model(pair):
    """A done for an unbound hold makes the source ask whether the engine reads from it: the
    plan it judges by is the decode's, and no plan made by the prefill's own model is kept."""
    p, d, *_ = pair
    p.hold("r", np.array([1, 2]))  # no consumer: unbound
    d.fetch("r", "P", [1, 2], [-1, -1])  # the decode has every block: nothing moves, its done goes out
    _drive(p, d, until=lambda got: False, seconds=0.3)
    plans = _source_plans(p)
    assert plans and all(plan["routes"] == STAGED for plan in plans), [plan["routes"] for plan in plans]
    assert all(plan["digest"] == d.plan_for("P").digest() for plan in plans)
