"""Retried fetches after a decode rank is SIGKILLed and restarted (issue 33, finding 11).

The finding: "after a decode rank is SIGKILLed and restarted, 12 of 360 retried fetches failed
in one of 20 trials (P2->D4 load, credential on)". This harness replays it over real NIXL
(:mod:`kvtriton.testing.faults`): one prefill engine at TP2 and one decode engine at TP4, every
rank its own process, the cluster's shared secret on (every meeting proves it, control messages
sealed under each pair's keys), every decode rank meeting every prefill rank over a lifeline.

Each trial, in one bed (one process start per trial, not six):

1. a wave of ``--wave`` requests is held on P0 and fetched by every D0 rank;
2. one decode rank (a different one each trial) is SIGKILLed while the wave is in flight;
3. it is restarted under the same engine id and rank, and meets every prefill rank again;
4. the requests of the wave that did not load everywhere are *retried* at once (new request
   ids, new blocks, as a proxy would), plus ``--extra`` fresh ones, and must all load byte-exact
   on all four ranks (``view(torch.uint8)`` against a reference rebuilt from the request's
   seed).

Counted per trial: wave requests lost (expected: the dead rank's part), retried fetches (one
per request and decode rank) that failed, their error types and messages, wrong bytes, and
what was left (holds, fetches in flight, staging slots) once settled.

Reproduce: ``.venv/bin/python bench/decode_restart.py --trials 20`` (~10 s per trial on a
loaded 2-core host, plus the bed's start). Exit status 1 when a retried fetch failed, a byte
was wrong or something leaked.
"""

from __future__ import annotations

if not __package__:  # `python bench/decode_restart.py`: run as `python -m bench.decode_restart`
    import _as_module  # type: ignore[import-not-found]

    _as_module.run_as_module(__file__)

import argparse
import logging
import sys
import time
from collections import Counter

from kvtriton.testing.faults import BedConfig, FaultBed

SECRET = b"issue-33-finding-11-shared-secret"


def run_trials(trials: int, wave: int = 6, extra: int = 4, p_tp: int = 2, d_tp: int = 4, secret: bool = True,
               seed: int = 0, timeout_s: float = 10.0, say=print) -> list[dict]:
    """One row per trial (module docstring)."""
    cfg = BedConfig(p_engines=1, d_engines=1, tp=p_tp, d_tp=d_tp, blocks=4096, timeout_s=timeout_s, lease_s=30.0,
                    secret=SECRET if secret else None, seed=seed)
    rows = []
    with FaultBed(cfg) as bed:
        warm = bed.new_requests("P0", "D0", 2)
        bed.submit(warm)
        bed.wait([r.req_id for r in warm], timeout_s=60)
        if any(bed.lost(r.req_id) for r in warm):
            raise RuntimeError(f"warm-up lost: {[bed.outcomes[r.req_id] for r in warm]}")
        for t in range(trials):
            victim = ("D0", t % d_tp)
            reqs = bed.new_requests("P0", "D0", wave)
            bed.submit(reqs)
            time.sleep(0.05)  # some pulls out, some answered
            bed.kill(victim)
            bed.wait([r.req_id for r in reqs], timeout_s=60, dead_decodes={victim})
            lost = [r for r in reqs if bed.lost(r.req_id) or victim[1] not in bed.outcomes[r.req_id]]
            met_s = bed.restart(victim)
            retried = bed.new_requests("P0", "D0", len(lost) + extra)
            bed.submit(retried)
            try:
                bed.wait([r.req_id for r in retried], timeout_s=60)
            except TimeoutError as e:
                say(f"trial {t}: {e}")
            outs = [o for r in retried for o in bed.outcomes[r.req_id].values()]
            failed = [o for o in outs if not o.ok]
            missing = sum(d_tp - len(bed.outcomes[r.req_id]) for r in retried)
            row = dict(trial=t, victim=f"D0:{victim[1]}", wave=len(reqs), wave_lost=len(lost),
                       restart_met_s=round(met_s, 2), meetings_s=round(met_s - bed.started_s, 2),
                       retried_fetches=len(outs) + missing, failed=len(failed),
                       no_outcome=missing, wrong_bytes=sum(o.mismatch is not None for o in outs),
                       errors=dict(Counter(o.error for o in failed)),
                       first_error=failed[0].msg if failed else None)
            rows.append(row)
            say(f"decode_restart: {row}")
        leaks = bed.leaks(timeout_s=20)
        rows.append(dict(trial="settled", holds_left=sum(v["holds"] for v in leaks.values()),
                         fetches_left=sum(bool(v["fetches_in_flight"]) for v in leaks.values()),
                         staging_slots_left=sum(v["staging_taken"] for v in leaks.values())))
        say(f"decode_restart: {rows[-1]}")
    return rows


def bad(rows: list[dict]) -> bool:
    trials = [r for r in rows if r["trial"] != "settled"]
    settled = rows[-1]
    return (any(r["failed"] or r["no_outcome"] or r["wrong_bytes"] for r in trials)
            or bool(settled["holds_left"] or settled["fetches_left"] or settled["staging_slots_left"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--wave", type=int, default=6)
    ap.add_argument("--extra", type=int, default=4)
    ap.add_argument("--p-tp", type=int, default=2)
    ap.add_argument("--d-tp", type=int, default=4)
    ap.add_argument("--no-secret", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=10.0, help="each agent's timeout_s (the old agent of a killed "
                    "rank is taken as silent after it)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    t0 = time.monotonic()
    rows = run_trials(args.trials, args.wave, args.extra, args.p_tp, args.d_tp, not args.no_secret, args.seed,
                      args.timeout_s)
    trials = [r for r in rows if r["trial"] != "settled"]
    fetches = sum(r["retried_fetches"] for r in trials)
    failed = sum(r["failed"] + r["no_outcome"] for r in trials)
    hit = sum(1 for r in trials if r["failed"] or r["no_outcome"])
    errors: Counter = Counter()
    for r in trials:
        errors.update(r["errors"])
    print(f"decode_restart: {len(trials)} trials, {fetches} retried fetches, {failed} failed in {hit} trials, "
          f"errors {dict(errors)}, wrong bytes {sum(r['wrong_bytes'] for r in trials)}, settled {rows[-1]}, "
          f"{time.monotonic() - t0:.0f} s")
    return 1 if bad(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
