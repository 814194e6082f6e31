"""Tier 1: SGLang's real disaggregation classes with the ``kvtriton`` backend, no model.

Everything runs in the SGLang test bed (``make sglang-bed``): the plugin through SGLang's own
plugin loader; the backend's refusals; and :mod:`beds.sglang_bed`, which starts the
prefill and decode ranks as separate processes holding SGLang's real pool and metadata buffers,
SGLang's bootstrap server, and the manager, sender and receiver that
``get_kv_class`` returns, over real NIXL. Each case checks every byte of the decode pages and
metadata rows against a reference drawn from the room's seed, for rooms whose length is not a
multiple of the page size; a control before the first transfer shows the decode pages did not
hold that reference already. The TP pair 2->3 (a pair SGLang's own backends cannot do; 1->2 and
2->1, with the same checks: ``bench/sglang_pairs.py``), an abort, and a prefill engine killed
while a decode waits on it.
"""

import json
import subprocess

import pytest
from helpers.sglang_bed_python import bed_env, sglang_bed_python

from beds.sglang_bed import MODEL_CONFIG, bytes_per_room, pair_problems
from beds.vllm_bed import free_port_range

pytestmark = [pytest.mark.sglang, pytest.mark.nixl]
PY = sglang_bed_python()


def _bed(code: str, timeout: int = 300, env: dict | None = None) -> dict:
    res = subprocess.run([PY, "-c", code], env=env or bed_env(), capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_import_kvtriton_does_not_import_sglang():
    got = _bed("import sys, json, kvtriton, kvtriton.integrations.sglang, kvtriton.integrations.sglang.plugin, "
               "kvtriton.integrations.sglang.settings, kvtriton.integrations.sglang.caches\n"
               "print(json.dumps(sorted(m for m in sys.modules if m == 'sglang' or m.startswith('sglang.'))))")
    assert got == []


PLUGIN = """
import json, os
from importlib.metadata import entry_points
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
from sglang.srt.disaggregation import decode, prefill, utils
out = {"entry": [e.value for e in entry_points(group="sglang.srt.plugins") if e.name == "kvtriton"],
       "choice": "kvtriton" in DISAGG_TRANSFER_BACKEND_CHOICES}
try:
    backend = utils.TransferBackend("kvtriton")
except ValueError as e:
    out["enum"] = str(e)
else:
    K = utils.KVClassType
    out["enum"] = backend.name
    out["classes"] = {m.__name__.split(".")[-1]: [getattr(m.get_kv_class(backend, t), "__name__", None)
                      for t in (K.MANAGER, K.SENDER, K.RECEIVER, K.BOOTSTRAP_SERVER)] for m in (utils, decode, prefill)}
    out["nixl"] = utils.get_kv_class(utils.TransferBackend.NIXL, K.MANAGER).__name__
print(json.dumps(out))
"""


def test_plugin_through_sglang_loader():
    got = _bed(PLUGIN)
    assert got["entry"] == ["kvtriton.integrations.sglang.plugin:register"] and got["choice"]
    assert got["enum"] == "KVTRITON"
    want = ["KVTritonKVManager", "KVTritonKVSender", "KVTritonKVReceiver", "KVTritonKVBootstrapServer"]
    assert got["classes"] == {"utils": want, "decode": want, "prefill": want}  # every importer sees the hook
    assert got["nixl"] == "NixlKVManager"  # SGLang's own backends answer as before


def test_plugin_off_when_sglang_plugins_leaves_it_out():
    """Negative control: SGLang's allowlist without ``kvtriton`` leaves the backend unknown."""
    got = _bed(PLUGIN, env={**bed_env(), "SGLANG_PLUGINS": "no-such-plugin"})
    assert not got["choice"] and "not a valid TransferBackend" in got["enum"]


REFUSALS = """
import json
from types import SimpleNamespace
from sglang.srt.disaggregation.base.conn import StateType
from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
from sglang.srt.server_args import ServerArgs
from kvtriton.integrations.sglang import plugin
plugin.register()
from kvtriton.integrations.sglang.conn import refuse_unsupported
from kvtriton.integrations.sglang.settings import UnsupportedSetupError
publish(ServerArgs(model_path=MODEL, device="cpu", disaggregation_mode="decode",
                   disaggregation_transfer_backend="kvtriton"), role="test", ranks=SpawnRanks(world_rank=0))
def args(**kw):
    return SimpleNamespace(**{"state_types": [], "num_draft_entries": 0, "kv_layout": None, **kw})
out = {}
def check(name, a, mla=False, **par):
    try:
        if par:
            with get_parallel().override(**par):
                refuse_unsupported(a, mla)
        else:
            refuse_unsupported(a, mla)
    except UnsupportedSetupError as e:
        out[name] = str(e)
    else:
        out[name] = None
check("plain", args())
check("mla", args(), mla=True)
check("mamba", args(state_types=[StateType.MAMBA]))
check("fp8_scales", args(state_types=[StateType.BLOCK_SCALE]))
check("draft", args(num_draft_entries=4))
check("pp", args(), pp_size=2)
print(json.dumps(out))
"""


def test_unsupported_cases_refused_at_start(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    got = _bed(REFUSALS.replace("MODEL", repr(str(tmp_path))))
    assert got["plain"] is None
    for case, says in {"mla": "MLA", "mamba": "hybrid state pools", "fp8_scales": "block-scale pools",
                       "draft": "draft model", "pp": "pipeline parallelism (pp_size=2)"}.items():
        assert got[case] and says in got[case], (case, got[case])


def _run(case: str, tmp_path) -> dict:
    (tmp_path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    base = free_port_range(60)
    res = subprocess.run([PY, "-m", "beds.sglang_bed", case, "--base-port", str(base), "--model",
                          str(tmp_path)], env=bed_env(), capture_output=True, text=True, timeout=2400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _ok(room: dict, d_tp: int) -> None:
    assert room["decode"] == ["Success"] * d_tp and set(room["prefill"]) == {"Success"}, room
    assert room["bytes_checked"] == bytes_per_room(room["tokens"], d_tp), room
    assert room["bytes_mismatched"] == 0 and room["aux_rows_mismatched"] == 0, room


def _no_leaks(leaks: dict) -> None:
    for side in leaks.values():
        for rank in side:
            assert rank == {"staging_in_use": 0, "holds": 0, "fetches": 0, "rooms": 0, "status_rooms": 0}, leaks


# P2 -> D3 only: a pair SGLang's own backends cannot do, whose decode ranks each read a part of
# one prefill rank's heads or parts of two (the split of 1-2 and the merge of 2-1 at once).
# P1 -> D2 and P2 -> D1 run the same oracles in `bench/sglang_pairs.py` (a matrix belongs in the
# benchmark): test_sglang_servers.py runs both end to end on real SGLang servers in CI.
@pytest.mark.parametrize("pair", ["2-3"])
def test_tp_pair(pair, tmp_path):
    """Every oracle of a pair (:func:`beds.sglang_bed.pair_problems`): the control, bytes and
    metadata rows of every room against the reference, the abort on both sides, no leak."""
    got = _run(pair, tmp_path)
    problems = pair_problems(got)
    assert not problems, problems


def test_killed_prefill_fails_its_request_only(tmp_path):
    got = _run("killed_prefill", tmp_path)
    assert got["killed_room"] == ["Failed"], got
    assert all("PeerDisconnectedError" in f for f in got["killed_failures"]), got["killed_failures"]
    _ok(got["other"], 1)
    _no_leaks(got["leaks"])


def test_rogue_client_cannot_touch_a_sealed_room(tmp_path):
    """With a cluster secret, a client without it forges WANT (claiming the room first), ABORT
    (SGLang's and ours), READY (other page ids and metadata rows) and STATUS (a failure), unsealed
    and sealed under another key, while an honest room transfers: every forgery is refused and
    counted, the room succeeds byte-exact (old code: the forged WANT took the room, the forged
    ABORT, READY or STATUS spoiled it); a real abort afterwards still fails that room on both sides."""
    got = _run("rogue", tmp_path)
    room = got["room"]
    _ok(room, 1)
    assert room["prefill_refused_before_want"] == 2, room  # the forged WANTs, before the decode's own
    assert room["prefill_refused_after_want"] == room["sent"]["prefill"], room  # and the forged ABORTs
    assert room["decode_refused_before_ready"] >= room["sent"]["decode"], room
    assert room["refused"] == {"prefill": [room["sent"]["prefill"]], "decode": [room["sent"]["decode"]]}, room
    abort = got["abort"]  # a real abort still reaches the prefill, sealed
    assert abort["decode"] == ["Failed"] and abort["prefill"] == ["Failed"], abort
    assert all("RequestAbortedError" in f for f in abort["prefill_failures"]), abort
    assert got["refused_after"] == room["refused"], got  # nothing honest was refused
    assert all(n > 0 for side in got["inline_steps"].values() for n in side), got  # poll() progressed the agent
    _no_leaks(got["leaks"])
