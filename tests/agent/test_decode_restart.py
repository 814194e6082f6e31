"""A decode rank SIGKILLed under a wave of fetches and restarted under the same engine id, the
cluster's shared secret on, its wave retried at once (issue 33, finding 11; the full harness,
P2->D4 over many trials, is bench/decode_restart.py): every retried fetch loads byte-exact on
every decode rank (decode TP twice the prefill's), and nothing is left held once settled."""

from __future__ import annotations

import pytest

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl


def test_retried_fetches_after_a_decode_restart_all_load():
    from bench.decode_restart import bad, run_trials

    rows = run_trials(1, wave=3, extra=2, p_tp=1, d_tp=2, secret=True, say=lambda *_: None)
    trials = rows[:-1]
    assert [r["victim"] for r in trials] == ["D0:0"]
    assert all(r["retried_fetches"] == 2 * (r["wave_lost"] + 2) for r in trials), trials
    assert not bad(rows), rows
