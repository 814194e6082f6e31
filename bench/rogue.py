"""Rogue-peer stress: what a connected but hostile engine can do to an honest transfer.

Two parts, both in one process over real NIXL (UCX on 127.0.0.1), every agent its own NIXL
agent, the rogue's handshake genuine (:class:`kvtriton.testing.rogue.RogueRig`):

* **scenarios**: each runs one honest request (chunked through a prefill pool a third its
  size) while the rogue attacks: pins staging with pulls it never acks, acks slowly as a
  hold's consumer, forges ``done``/``renew`` for holds it may not touch, squats the honest
  transfer id, forges ``ready`` to the decode, floods messages, sends garbage or a 4M-id
  ``pull``. Reported per scenario: whether the honest request completed byte-exact, bytes
  outside the request's blocks changed (decode) and anywhere (prefill), staging slots still
  taken after settling, the longest ``progress()`` call.
* **load**: 256 concurrent requests into a TP4 decode engine from a TP2 prefill engine (1024
  fetches), once alone and once with the rogue pinning staging, forging and flooding all along:
  lost requests, wrong bytes (every byte of every decode cache is checked), honest throughput
  with the rogue over without.

Reproduce: ``.venv/bin/python bench/rogue.py`` (or the ``rogue`` section of bench/sweep.py);
writes ``bench/results/rogue.md``. Bounded: about 30 s on a 2-core VM.
"""

from __future__ import annotations

if not __package__:  # `python bench/rogue.py`: run as `python -m bench.rogue` (bench/_as_module.py)
    import _as_module

    _as_module.run_as_module(__file__)

import logging
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import torch

from bench.report import rogue_summary  # bench/report.py
from kvtriton.agent import TransferAgent
from kvtriton.protocol import wire
from kvtriton.testing.oracle import (
    RegionModel,
    check_destination,
    load_source,
    make_global_kv,
    make_rank_regions,
    snapshot,
)
from kvtriton.testing.rogue import RogueRig

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 0.4  # every agent's silence timeout (short, so settling is quick)
SCENARIO_MODELS = [RegionModel.gqa("l0", 4, 16)]


# --------------------------------------------------------------------------- scenarios
class Scenario:
    """``before(x)`` runs once before the honest fetch, ``tick(x, i)`` on every step after it."""

    name = ""
    min_s = 0.0  # keep attacking at least this long, even after the honest request finished

    def before(self, x: RogueRig) -> None:
        pass

    def tick(self, x: RogueRig, i: int) -> None:
        pass


class PinStaging(Scenario):
    name = "pin staging: 12 pulls never acked"

    def before(self, x):
        for p in range(x.p_tp):
            for k in range(12):
                x.pa[p].hold(f"bait{k}", [40 + k, 52 + k % 8])
                x.rogue_pull(f"bait{k}", [40 + k, 52 + k % 8], chunk_blocks=1, to=p)


class SlowConsumer(Scenario):
    name = "slow consumer: acks just before each deadline"

    def before(self, x):
        self.readies, self.next_ack = [], 0.0
        x.pa[0].hold("slow", np.arange(40, 64), lease_s=0.3)
        x.rogue_pull("slow", np.arange(40, 64), chunk_blocks=1)

    def tick(self, x, i):
        self.readies += [m for m in x.rogue_inbox() if isinstance(m, wire.Ready)]
        if self.readies and time.monotonic() > self.next_ack:
            r = self.readies.pop(0)
            x.forge(wire.Ack(r.xid, r.chunk))
            self.next_ack = time.monotonic() + 0.8 * TIMEOUT_S


class ForgedDone(Scenario):
    name = "forged done for the honest hold"

    def before(self, x):
        for p in range(x.p_tp):
            x.forge(wire.Done("honest", 0, 1), p)

    def tick(self, x, i):
        if i % 5 == 0:
            for p in range(x.p_tp):
                x.forge(wire.Done("honest", 0, 1), p)


class ForeignRenew(Scenario):
    name = "renew of holds not the rogue's"
    min_s = 0.6  # the bait's lease is 0.2 s: renewed every step, it must still run out

    def before(self, x):
        x.pa[0].hold("bait", [60], lease_s=0.2)
        self.t0 = time.monotonic()

    def tick(self, x, i):
        for req in ("bait", "honest"):
            x.forge(wire.Renew(req, 0))


class SquatXid(Scenario):
    name = "squat the honest transfer id"

    def before(self, x):
        x.pa[0].hold("bait", [50, 51])
        for p in range(x.p_tp):
            x.forge(wire.Pull(f"honest|D:0<{p}#{p}", "bait", 0, (50, 51), 1, x.rogue.plan_for("P").digest()), p)

    def tick(self, x, i):
        for p in range(x.p_tp):
            xid = f"honest|D:0<{p}#{p}"  # what D:0 names its transfer from P:p
            for m in (wire.Abort(xid), wire.Ack(xid, i % 3), wire.RunsDone(xid)):
                x.forge(m, p)


class ForgedReady(Scenario):
    name = "forged ready to the decode"

    def before(self, x):
        x.connect_rogue_to_decode()

    def tick(self, x, i):
        for d in x.da:
            for xid in list(d.debug_state()["parts"]):
                for body in (dict(chunk=0, slot=0, nslots=1, nbytes=1024), dict(chunk=-1, slot=0, nslots=1, nbytes=-1),
                             dict(chunk=99, slot=0, nslots=0, nbytes=1024)):
                    x.rogue.transport.send_notif(d.transport.name, wire.encode_message("Ready", xid=xid, **body))


class Garbage(Scenario):
    name = "garbage and malformed messages"

    def before(self, x):
        self.rng = np.random.default_rng(7)
        x.connect_rogue_to_decode()

    def tick(self, x, i):
        raw = [self.rng.bytes(int(self.rng.integers(1, 80))),
               msgpack.packb({"v": True, "t": "Done", "req": "honest", "dst_rank": 0, "dst_tp": 1}),
               msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "Ack", "xid": "", "chunk": -7}),
               msgpack.packb({"v": float(wire.PROTOCOL_VERSION), "t": "Abort", "xid": "honest|D:0<0#0"})]
        for p in range(x.p_tp):
            for r in raw:
                x.forge(r, p)
        x.rogue.transport.send_notif(x.da[0].transport.name, raw[0])


class HugePull(Scenario):
    name = "pull of 4M ids"

    def before(self, x):
        x.forge(msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "Pull", "xid": "huge", "req": "honest", "dst_rank": 0,
                               "ids": list(range(1 << 22)), "chunk_blocks": 1, "plan": "p"}))


class Flood(Scenario):
    name = "flood: 20,000 messages at once"

    def before(self, x):
        for k in range(20_000):
            x.forge(wire.Abort(f"nothing{k}"), k % x.p_tp)


SCENARIOS = [PinStaging, SlowConsumer, ForgedDone, ForeignRenew, SquatXid, ForgedReady, Garbage, HugePull, Flood]


def _changed_bytes(now, was, keep_blocks=None) -> int:
    """Bytes that differ between two snapshots, outside ``keep_blocks`` (block ids) if given."""
    n = 0
    for rn, rw in zip(now, was):
        for a, b in zip(rn, rw):
            diff = a != b
            if keep_blocks is not None and len(keep_blocks):
                diff[torch.as_tensor(np.asarray(keep_blocks))] = False
            n += int(diff.sum())
    return n


def run_scenario(cls, seed: int) -> dict:
    sc = cls()
    x = RogueRig(2, 1, models=SCENARIO_MODELS, staging_bytes=8 << 10, slot_bytes=1024, timeout_s=TIMEOUT_S,
                 seed=seed)
    try:
        src = np.random.default_rng(seed).permutation(40)[:24]
        dst = np.random.default_rng(seed + 1).permutation(64)[:24]
        kv = x.request(src)
        p_before = [snapshot(r) for r in x.P]
        for p in x.pa:
            p.hold("honest", src, lease_s=30)
        sc.before(x)
        x.step()
        for d in x.da:
            d.fetch("honest", "P", src, dst, timeout_s=5.0)
        got, i, t0 = [], 0, time.monotonic()
        while (not got or time.monotonic() - t0 < sc.min_s) and time.monotonic() - t0 < 15:
            x.step()
            sc.tick(x, i)
            i += 1
            got += x.da[0].results()
        ok = bool(got) and got[0].ok
        try:
            check_destination(x.D[0], 0, 1, kv, dst)
            exact = ok
        except AssertionError:
            exact = False
        outside_d = _changed_bytes(snapshot(x.D[0]), x.before[0], keep_blocks=dst)
        outside_p = sum(_changed_bytes(snapshot(r), b) for r, b in zip(x.P, p_before))
        renew_ok = True
        if isinstance(sc, ForeignRenew):  # the bait's lease ran out on time despite the renewals
            renew_ok = "bait" not in x.pa[0].debug_state()["holds"]
        x.settle(3 * TIMEOUT_S + 0.3)  # rogue transfers expire, their slots leave quarantine
        leaked = sum(a.pool.num_slots - a.pool.free_slots for a in x.honest)
        return dict(scenario=sc.name, honest_ok=ok and exact and renew_ok, outside_bytes_changed=outside_d + outside_p,
                    staging_leaked_slots=leaked, max_progress_ms=round(x.max_progress_s * 1e3, 1),
                    bad_messages=sum(a.stats["bad_messages"] for a in x.honest),
                    refused=sum(a.stats["refused"] for a in x.honest))
    finally:
        x.close()


# --------------------------------------------------------------------------- load
def load_run(with_rogue: bool, n_requests: int = 256, blocks: int = 4, seed: int = 0) -> dict:
    """``n_requests`` requests of ``blocks`` blocks, all fetched at once by every rank of a TP4
    decode engine from a TP2 prefill engine; optionally with a rogue attacking all along."""
    gen = torch.Generator().manual_seed(seed)
    models = [RegionModel.gqa("l0", 8, 16)]
    bs, nb = 4, n_requests * blocks + 64
    kw = dict(staging_bytes=64 << 10, slot_bytes=1024, timeout_s=2.0, impl="torch")
    P = [make_rank_regions(models, r, 2, nb, bs, gen=gen) for r in range(2)]
    D = [make_rank_regions(models, r, 4, nb, bs, layout="HND", gen=gen) for r in range(4)]
    pa = [TransferAgent("P", r, 2, P[r], **kw) for r in range(2)]
    da = [TransferAgent("D", r, 4, D[r], **kw) for r in range(4)]
    rogue = TransferAgent("R", 0, 1, make_rank_regions(models, 0, 1, nb, bs, gen=gen), **kw) if with_rogue else None
    agents = pa + da
    try:
        for p in pa:
            for x in da + ([rogue] if rogue else []):
                x.add_remote(p.metadata())
                p.add_remote(x.metadata())
        rng = np.random.default_rng(seed)
        src_all = rng.permutation(nb - 64)[: n_requests * blocks].reshape(n_requests, blocks)
        dst_all = rng.permutation(nb)[: n_requests * blocks].reshape(n_requests, blocks)
        before = [snapshot(x) for x in D]
        kv = make_global_kv(models, n_requests * blocks, bs, gen)
        for r in range(2):
            load_source(P[r], r, 2, kv, src_all.reshape(-1))
        bait = np.arange(nb - 64, nb)
        for i in range(n_requests):
            for p in pa:
                p.hold(f"q{i}", src_all[i], lease_s=60, consumer="D")  # named: the rogue may not bind it
        plan = rogue.plan_for("P").digest() if rogue else None
        n_bait = 0

        def attack(step: int) -> None:
            nonlocal n_bait
            for p in range(2):
                if step % 20 == 0:  # keep pinning: fresh pulls once the old ones expire
                    req = f"bait{n_bait}"
                    n_bait += 1
                    pa[p].hold(req, bait[:16], lease_s=60)
                    raw = wire.Pull(f"r{n_bait}", req, 0, tuple(bait[:16].tolist()), 1, plan).encode()
                    rogue.transport.send_notif(pa[p].transport.name, raw)
                q = f"q{step % n_requests}"
                for m in (wire.Done(q, 0, 1), wire.Renew(q, 0), wire.Abort(f"{q}|D:0<{p}#0"),
                          wire.Pull(f"{q}|D:0<{p}#0", q, 0, tuple(src_all[step % n_requests].tolist()), 1, plan)):
                    rogue.transport.send_notif(pa[p].transport.name, m.encode())
            rogue.transport.poll_notifs()

        if rogue:  # pin its share of each prefill rank's pool before the honest requests arrive
            for _ in range(16):
                attack(0)
            for a in pa:
                a.progress()
        t0 = time.perf_counter()
        for i in range(n_requests):
            for d in da:
                d.fetch(f"q{i}", "P", src_all[i], dst_all[i], timeout_s=30)
        results, step = [], 0
        deadline = time.monotonic() + 120
        while len(results) < 4 * n_requests and time.monotonic() < deadline:
            for a in agents:
                a.progress()
            for d in da:
                results += d.results()
            if rogue:
                attack(step)
            step += 1
        wall = time.perf_counter() - t0
        ok = sum(r.ok for r in results if r.req_id.startswith("q"))
        wrong = 0
        for r in range(4):
            try:
                check_destination(D[r], r, 4, kv, dst_all.reshape(-1), before[r])
            except AssertionError:
                wrong += 1
        return dict(rogue=with_rogue, requests=n_requests, decode_ranks=4, fetches=4 * n_requests,
                    completed=ok, lost=4 * n_requests - ok, ranks_with_wrong_bytes=wrong, seconds=round(wall, 2),
                    requests_per_s=round(n_requests / wall, 1),
                    p_refused=sum(p.stats["refused"] for p in pa),
                    p_bad_messages=sum(p.stats["bad_messages"] for p in pa))
    finally:
        for a in agents + ([rogue] if rogue else []):
            a.close()


# --------------------------------------------------------------------------- report
def load_runs(quick: bool) -> int:
    """Load runs :func:`run_rogue_bench` makes: with and without the rogue, twice each (once each quick)."""
    return 2 if quick else 4


def run_rogue_bench(quick: bool = False, progress=None) -> list[dict]:
    """Every scenario, then the load run (``quick``: 64 requests, one run with and one without the
    rogue; else 256, two each). ``progress(what)``: called as each scenario and load run finishes."""
    logging.getLogger("kvtriton").setLevel(logging.ERROR)  # every refused message logs a warning
    tick = progress or (lambda what: None)
    rows = []
    for k, cls in enumerate(SCENARIOS):
        rows.append({"part": "scenario", **run_scenario(cls, seed=k)})
        print(f"rogue: {rows[-1]}", flush=True)
        tick(rows[-1].get("scenario", cls.__name__))
    n = 64 if quick else 256
    # interleaved with and without; the faster of each kind kept (the 2-core VM is shared and noisy)
    runs = []
    for k in range(load_runs(quick) // 2):
        for rogue in (False, True):
            runs.append(load_run(rogue, n, seed=k))
            tick(f"load, {'rogue' if rogue else 'no rogue'}")
    base = min((r for r in runs if not r["rogue"]), key=lambda r: r["seconds"])
    attacked = min((r for r in runs if r["rogue"]), key=lambda r: r["seconds"])
    for r in (base, attacked):  # losses and wrong bytes of every run count, not only the kept one
        same = [x for x in runs if x["rogue"] == r["rogue"]]
        r["lost"] = sum(x["lost"] for x in same)
        r["ranks_with_wrong_bytes"] = sum(x["ranks_with_wrong_bytes"] for x in same)
        r["runs"] = len(same)
    ratio = round(base["requests_per_s"] / attacked["requests_per_s"], 2) if attacked["requests_per_s"] else None
    for r in (base, attacked):
        rows.append({"part": "load", **r, "slowdown_vs_no_rogue": ratio if r["rogue"] else 1.0})
        print(f"rogue: {rows[-1]}", flush=True)
    return rows


def main() -> int:
    t0 = time.time()
    rows = run_rogue_bench()
    out = HERE / "results" / "rogue.md"
    out.write_text("\n".join(["# kvtriton rogue-peer stress", "",
                              f"Reproduce: `.venv/bin/python bench/rogue.py` ({time.time() - t0:.0f} s, "
                              f"cpu, torch {torch.__version__}).", ""] + rogue_summary(rows)))
    print(f"wrote {out}")
    sc = [r for r in rows if r["part"] == "scenario"]
    load = [r for r in rows if r["part"] == "load"]
    bad = [r for r in sc if not r["honest_ok"] or r["outside_bytes_changed"] or r["staging_leaked_slots"]]
    bad += [r for r in load if r["lost"] or r["ranks_with_wrong_bytes"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
