"""The vLLM plugin entry point: a real engine finds KVTritonConnector by name, no module path.

vLLM discovers general plugins through ``importlib.metadata`` (the ``vllm.general_plugins`` entry
points of every distribution on ``sys.path``) in each of its processes. The entry point this
checkout declares is in ``pyproject.toml``; the test bed's kvtriton is installed (editable) from
another checkout, whose metadata may predate it. So when the bed's installed kvtriton does not
declare it, the test puts a one-file distribution on the engine's ``PYTHONPATH``
(``kvtriton_plugin_under_test-0.dist-info/entry_points.txt``, holding exactly the entry point
``pyproject.toml`` declares) and names it in ``VLLM_PLUGINS``: the engine then discovers, loads
and calls it through vLLM's own plugin loading, and imports this checkout's kvtriton
(``PYTHONPATH`` first). Once the bed is reinstalled from a checkout that has the entry point, the
installed one is used and nothing is added. Negative control: the same engine with
``VLLM_PLUGINS`` naming no plugin must refuse ``KVTritonConnector`` as unknown.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers.vllm_bed_python import vllm_bed_python

from beds.vllm_bed import EngineProcess, engine_cpus, free_port_range

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (pyproject.toml is read as the user's pip reads it)
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.vllm
VLLM_PY = vllm_bed_python()

DECLARED = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
NAME, VALUE = next(iter(DECLARED.items()))


def _bed(code: str, env: dict) -> str:
    res = subprocess.run([VLLM_PY, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    """The environment an engine needs to find this checkout's entry point (see the module docstring)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "VLLM_PLUGINS": NAME}
    find = ("import importlib.metadata as m, json; print(json.dumps([[e.name, e.value] for e in "
            "m.entry_points(group='vllm.general_plugins')]))")
    if [NAME, VALUE] not in json.loads(_bed(find, env)):
        shim = tmp_path_factory.mktemp("plugin-dist")
        info = shim / "kvtriton_plugin_under_test-0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvtriton-plugin-under-test\nVersion: 0\n")
        (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{NAME} = {VALUE}\n")
        env["PYTHONPATH"] += os.pathsep + str(shim)
    found = json.loads(_bed(find, env))
    assert found.count([NAME, VALUE]) == 1, found
    return env


def test_register_is_idempotent_and_imports_no_vllm_before(plugin_env):
    """The plugin module and ``import kvtriton`` leave vLLM unimported; the entry point resolves to
    this checkout's function; registering twice keeps the first registration and the class is
    the connector."""
    code = ("import sys, json, importlib.metadata as m\n"
            "import kvtriton, kvtriton.integrations.vllm.plugin as p\n"
            "before = 'vllm' in sys.modules\n"
            f"ep = [e for e in m.entry_points(group='vllm.general_plugins') if e.name == {NAME!r}][0]\n"
            "fn = ep.load()\n"
            "first, second = fn(), fn()\n"
            "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F\n"
            "cls = F.get_connector_class_by_name('KVTritonConnector')\n"
            "print(json.dumps([before, fn is p.register, first, second, cls.__module__ + '.' + cls.__name__, "
            "kvtriton.__file__]))")
    before, same, first, second, cls, where = json.loads(_bed(code, plugin_env))
    assert before is False and same is True
    assert (first, second) == (True, False)
    assert cls == "kvtriton.integrations.vllm.connector.KVTritonConnector"
    assert where == str(ROOT / "kvtriton" / "__init__.py")  # this checkout, not the bed's install


def test_engine_loads_the_connector_by_name(plugin_env, model_dir, tmp_path):
    """An engine with ``kv_connector="KVTritonConnector"`` and no ``kv_connector_module_path``
    builds kvtriton's connector (its worker has a TransferAgent) and serves a request; with the
    plugin filtered out (``VLLM_PLUGINS`` naming none) the same engine refuses the name."""
    common = dict(tp=1, connector="kvtriton-plugin", role="kv_both", block_size=32, max_model_len=512,
                  extra={"handshake_timeout_s": 20.0}, log_dir=tmp_path)
    # both engines start at once, each on a core of its own (the refusal comes after vLLM's imports)
    bed = EngineProcess.launch(VLLM_PY, model_dir, port=free_port_range(1), name="plugin", env=plugin_env,
                               cpus=engine_cpus(1, 0), **common)
    refused = EngineProcess.launch(VLLM_PY, model_dir, port=free_port_range(1), name="no-plugin",
                                   env={**plugin_env, "VLLM_PLUGINS": "none-of-them"}, cpus=engine_cpus(1, 1), **common)
    try:
        try:
            bed.wait_ready()
            out = bed.call("generate", requests=[{"id": "a", "prompt": list(range(1, 41)), "max_tokens": 2}])
            assert len(out["outputs"][0]["tokens"]) == 2
            stats = bed.call("agent_stats")["stats"]
            assert isinstance(stats, list) and isinstance(stats[0], dict), stats  # None on any other connector
        finally:
            bed.close()
        log = (tmp_path / "plugin.log").read_text()
        assert "Creating v1 connector with name: KVTritonConnector" in log
        with pytest.raises(RuntimeError, match="Unsupported connector type: KVTritonConnector"):
            refused.wait_ready()
    finally:
        refused.close()
