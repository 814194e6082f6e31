"""The ``kvtriton`` command: ``plan``, ``doctor``, ``costmodel``, run as a user runs them.

Every case runs the command in a child process, both as the console entry point and as
``python -m kvtriton``. The entry point: the installed ``kvtriton`` script when the installed
distribution declares the one ``pyproject.toml`` declares, else the call pip's generated wrapper
makes (import the ``module:function`` that ``pyproject.toml`` names, exit with its return value),
since this venv's kvtriton may be installed from another checkout. Outputs are parsed (``--json``),
errors checked by type and text, exit codes exactly.
"""

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtriton.cli.doctor import TESTED
from kvtriton.cli.plan import explain, nixl_connector_descriptors
from kvtriton.errors import RegionError, TopologyError
from kvtriton.plan import build_plan
from kvtriton.plan.models import PRESETS, from_hf_config, load_model, rank_specs
from kvtriton.spec import Kind

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (pyproject.toml is read as the user's pip reads it)
ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPT = PYPROJECT["project"]["scripts"]["kvtriton"]

# Llama-3-70B's KV geometry, as its config.json states it (no weights)
LLAMA70B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "num_attention_heads": 64,
            "num_key_value_heads": 8, "num_hidden_layers": 80, "torch_dtype": "bfloat16", "vocab_size": 128256}


def _entry_point() -> list[str]:
    installed = [e for e in md.entry_points(group="console_scripts", name="kvtriton") if e.value == SCRIPT]
    exe = shutil.which("kvtriton", path=str(Path(sys.executable).parent))
    if installed and exe:
        return [exe]
    module, func = SCRIPT.split(":")
    return [sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}())"]


@pytest.fixture(params=["entry-point", "python-m"])
def kvtriton(request, tmp_path):
    """Run ``kvtriton ARGS`` in a child (this checkout first on its path, an empty cost-model
    cache): returns ``(returncode, stdout, stderr)``."""
    cmd = _entry_point() if request.param == "entry-point" else [sys.executable, "-m", "kvtriton"]
    base = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "UCX_TLS")}
    base.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                KVTRITON_CACHE_DIR=str(tmp_path / "cache"), TRITON_DEFAULT_FP_FUSION="1", OMP_NUM_THREADS="1")

    def run(*args: str, env: dict | None = None, timeout: float = 120) -> tuple[int, str, str]:
        res = subprocess.run([*cmd, *args], env={**base, **(env or {})}, capture_output=True, text=True,
                             timeout=timeout, cwd=tmp_path)
        return res.returncode, res.stdout, res.stderr

    run.cache = tmp_path / "cache"
    return run


@pytest.fixture
def llama_config(tmp_path):
    path = tmp_path / "Meta-Llama-3-70B" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(LLAMA70B))
    return path


def _cache_file(cache: Path, **numbers) -> Path:
    """A cached cost model where ``kvtriton`` children (1 torch thread) look for it."""
    from kvtriton import costmodel

    path = cache / "costmodel" / re.sub(r"-t\d+\.json$", "-t1.json", costmodel.cache_path("cpu", "ucx-default").name)
    path.parent.mkdir(parents=True, exist_ok=True)
    from kvtriton.plan import CostModel

    vals = {**CostModel().as_dict(), **numbers}
    path.write_text(json.dumps(dict(version=costmodel.CACHE_VERSION, source="test", **vals)))
    return path


# ------------------------------------------------------------------------------------------ plan
def test_plan_llama3_70b_p4_d8(kvtriton, llama_config):
    """The issue's figure: 1 staged descriptor per decode rank against vLLM 0.33's 40,960, exit 0."""
    rc, out, err = kvtriton("plan", "--model", str(llama_config), "--prefill-tp", "4", "--decode-tp", "8",
                            "--vllm", "0.33", "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert (rep["regions"], rep["split_regions"], rep["blocks"]) == (80, 80, 512)
    assert rep["cost_model"]["source"].startswith("default")  # nothing cached, nothing measured
    assert (rep["block_size"], rep["vllm"], rep["vllm_default_block"]) == (16, "0.33", 16)
    assert [r["decode_rank"] for r in rep["ranks"]] == list(range(8))
    payload_bytes = 512 * 80 * 2 * 16 * 1 * 128 * 2  # blocks x layers x K,V x tokens x 1 head x dim x bf16
    for r in rep["ranks"]:
        d = r["decode_rank"]
        p0 = d // 2 * 2  # prefill rank d // 2 holds heads p0, p0 + 1
        assert r["sources"] == [dict(total_heads=8, regions=80, decode_heads=[d, d + 1],
                                     reads=[dict(src_rank=d // 2, heads=[d, d + 1], holds=[p0, p0 + 2])])]
        assert {x["route"] for x in r["routes"]} == {"staged"} and len(r["routes"]) == 80
        (p,) = r["payloads"]
        assert (p["src_rank"], p["bytes"], p["segments"]) == (d // 2, payload_bytes, 160)
        assert p["ways"]["staged"]["descriptors"] == 1 and p["ways"]["staged"]["bytes_per_descriptor"] == payload_bytes
        # D > P: the decode's tile is its whole block (pack_place); HND: its heads are one range
        # inside the prefill block (direct_slice)
        assert set(p["ways"]) == {"staged", "pack_place", "direct_slice"}
        assert p["ways"]["pack_place"]["descriptors"] == 160 * 512 // 8  # per segment, one per run of 8 ids
        assert p["ways"]["direct_slice"]["descriptors"] == 160 * 512  # per segment and block: a partial slice
        assert p["chosen"] in p["ways"]
        assert r["kvtriton"]["staged_descriptors"] == 1
        assert r["vllm"] == dict(descriptors=40960, bytes_per_descriptor=8192, descriptors_kv_separate=81920)
    rc, text, err = kvtriton("plan", "--model", str(llama_config), "--prefill-tp", "4", "--decode-tp", "8",
                             "--vllm", "0.33", "--rank", "5")
    assert rc == 0, err
    assert "decode rank 5:" in text and "decode rank 4:" not in text
    assert "block 16 (vLLM 0.33's default)" in text
    assert "kvtriton: 1 staged descriptor " in text and "vLLM 0.33 NixlConnector: 40,960 descriptors of 8,192 B" in text


def test_plan_block_size_follows_the_vllm_release(kvtriton, llama_config):
    """vLLM 0.34 made 64 the default block: with no --block-size the plan models it, and
    NixlConnector's reads of the same request are 4x fewer and 4x larger (32 KiB)."""
    args = ["plan", "--model", str(llama_config), "--prefill-tp", "4", "--decode-tp", "8", "--rank", "0"]
    rc, out, err = kvtriton(*args, "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert (rep["block_size"], rep["blocks"], rep["vllm"]) == (64, 128, "0.34")
    (r,) = rep["ranks"]
    assert r["vllm"] == dict(descriptors=10240, bytes_per_descriptor=32768, descriptors_kv_separate=20480)
    assert r["payloads"][0]["ways"]["staged"]["descriptors"] == 1
    assert r["payloads"][0]["ways"]["pack_place"]["descriptors"] == 160 * 128 // 8
    rc, text, err = kvtriton(*args, "--block-size", "16")
    assert rc == 0 and "block 16 (vLLM 0.34's default is 64)" in text, err
    assert "vLLM 0.34 NixlConnector: 40,960 descriptors of 8,192 B" in text
    rc, _, err = kvtriton(*args, "--vllm", "0.31")
    assert rc == 2 and "--vllm" in err


def test_plan_counts_staging_chunks(kvtriton, llama_config):
    rc, out, err = kvtriton("plan", "--model", str(llama_config), "--prefill-tp", "4", "--decode-tp", "8",
                            "--block-size", "16", "--chunk-mib", "64", "--rank", "3", "--json")
    assert rc == 0, err
    (r,) = json.loads(out)["ranks"]
    per_chunk = (64 << 20) // (80 * 2 * 16 * 128 * 2)  # whole blocks of one head, K and V, 80 layers
    chunks = -(-512 // per_chunk)
    assert (per_chunk, chunks) == (102, 6)
    assert r["payloads"][0]["chunks"] == chunks and r["kvtriton"]["staged_descriptors"] == chunks
    assert r["payloads"][0]["ways"]["staged"]["descriptors"] == chunks


def test_command_usage(kvtriton):
    rc, _, err = kvtriton()
    assert rc == 2 and "{plan,doctor,costmodel}" in err
    rc, out, _ = kvtriton("--version")
    assert rc == 0 and out.strip() == "kvtriton 0.1.0"
    rc, out, _ = kvtriton("plan", "--help")
    assert rc == 0 and "--prefill-tp" in out and "--json" in out


def test_plan_refuses_p2_d3_with_8_heads(kvtriton, llama_config):
    rc, out, err = kvtriton("plan", "--model", str(llama_config), "--prefill-tp", "2", "--decode-tp", "3")
    assert rc == 2 and out == ""
    assert err.startswith("kvtriton plan: TopologyError: ")
    assert "tp=3 cannot shard 8 KV heads" in err and "decode engine" in err
    with pytest.raises(TopologyError, match="tp=3 cannot shard 8 KV heads"):  # the planner's own error
        explain(load_model(str(llama_config)), 2, 3)


@pytest.mark.parametrize("args, error, text", [
    (["--model", "llama3-70b", "--prefill-tp", "4", "--decode-tp", "8", "--tokens", "0"], "PlanError", "tokens"),
    (["--model", "llama3-70b", "--prefill-tp", "4", "--decode-tp", "8", "--rank", "8"], "PlanError", "[8]"),
    (["--model", "llama-9000", "--prefill-tp", "1", "--decode-tp", "1"], "RegionError", "neither a preset"),
    (["--model", "llama3-70b", "--prefill-tp", "0", "--decode-tp", "1"], "TopologyError", "tp=0"),
    (["--model", "llama3-70b", "--prefill-tp", "1", "--decode-tp", "1", "--dtype", "int3"], "RegionError", "int3"),
])
def test_plan_bad_input_exits_2_with_a_typed_error(kvtriton, args, error, text):
    rc, out, err = kvtriton("plan", *args)
    assert (rc, out) == (2, "")
    assert err.startswith(f"kvtriton plan: {error}: ") and text in err, err


def test_plan_bad_config_and_bad_arguments(kvtriton, tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"num_attention_heads": 8}))
    rc, _, err = kvtriton("plan", "--model", str(tmp_path), "--prefill-tp", "1", "--decode-tp", "2")
    assert rc == 2 and "RegionError" in err and "num_hidden_layers" in err
    bad.write_text("{not json")
    rc, _, err = kvtriton("plan", "--model", str(bad), "--prefill-tp", "1", "--decode-tp", "2")
    assert rc == 2 and "RegionError" in err and "cannot read a JSON config" in err
    rc, _, err = kvtriton("plan", "--model", "llama3-8b", "--prefill-tp", "1")  # argparse: a required option
    assert rc == 2 and "--decode-tp" in err


def test_plan_uses_the_cached_model_and_never_measures(kvtriton):
    """A cached model decides the way (descriptors free: direct_slice; cheap: the one-sided way;
    ruinous: staged);
    ``--cost default`` ignores it; no model is measured (no file appears when none is cached)."""
    args = ["plan", "--model", "llama3-8b", "--prefill-tp", "1", "--decode-tp", "2", "--block-size", "16",
            "--rank", "0", "--json"]
    rc, out, _ = kvtriton(*args)
    assert rc == 0 and not kvtriton.cache.exists()
    _cache_file(kvtriton.cache, desc_us=1e-3)
    rep = json.loads(kvtriton(*args)[1])
    assert rep["cost_model"]["source"].startswith("cached ") and rep["cost_model"]["desc_us"] == 1e-3
    # descriptors free: zero-copy head slices (HND blocks), nothing staged
    assert {r["route"] for r in rep["ranks"][0]["routes"]} == {"direct_slice"} and not rep["ranks"][0]["payloads"]
    _cache_file(kvtriton.cache, desc_us=3.0)  # dearer than a 16 KiB slice's unpack, cheap against a pass per run
    assert json.loads(kvtriton(*args)[1])["ranks"][0]["payloads"][0]["chosen"] == "pack_place"
    _cache_file(kvtriton.cache, desc_us=1e4)
    assert json.loads(kvtriton(*args)[1])["ranks"][0]["payloads"][0]["chosen"] == "staged"
    assert json.loads(kvtriton(*args, "--cost", "default")[1])["cost_model"]["source"].startswith("default")


def test_plan_mixed_cache_and_mla(kvtriton):
    """GQA target + MLA draft: the draft goes DIRECT in coalesced runs, the baseline counts it once."""
    rc, out, err = kvtriton("plan", "--model", "llama3-8b+mla-draft", "--prefill-tp", "2", "--decode-tp", "4",
                            "--vllm", "0.33", "--run", "0", "--json")
    assert rc == 0, err
    for r in json.loads(out)["ranks"]:
        assert [x["route"] for x in r["routes"]] == ["staged"] * 32 + ["direct"]
        latent = 512 * 16 * 576 * 2  # every block's latent, one run of 512 blocks
        assert r["direct"] == dict(regions=1, descriptors=1, bytes=latent, bytes_per_descriptor=latent)
        assert r["kvtriton"]["staged_descriptors"] == 1
        assert r["vllm"]["descriptors"] == 32 * 512 + 512
    rc, out, _ = kvtriton("plan", "--model", "deepseek-v3", "--prefill-tp", "8", "--decode-tp", "4", "--vllm", "0.33",
                          "--json")
    r = json.loads(out)["ranks"][0]
    assert r["payloads"] == [] and r["replicate_sources"] == [0, 4]  # striped over two replicas
    assert r["direct"]["descriptors"] == 61 * 512 // 8 and r["vllm"]["descriptors"] == 61 * 512


def test_plan_subcommand_imports_no_torch():
    code = ("import sys; from kvtriton.cli import main; "
            "rc = main(['plan', '--model', 'llama3-70b', '--prefill-tp', '4', '--decode-tp', '8', '--json']); "
            "print(rc, sorted(m for m in ('torch', 'triton', 'nixl', 'vllm') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.stdout.strip().splitlines()[-1] == "0 []", res.stderr


def test_import_kvtriton_stays_light():
    code = ("import sys, kvtriton, kvtriton.cli, kvtriton.integrations.vllm.plugin; "
            "print(sorted(m for m in ('torch', 'triton', 'nixl', 'vllm', 'numpy') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.stdout.strip() == "[]", res.stdout + res.stderr


# ------------------------------------------------------------------------------------------ models
def test_hf_configs_map_to_the_regions_vllm_caches():
    m = from_hf_config(LLAMA70B, "llama70b")
    assert [(x.kind, x.total_heads, x.head_dims, x.dtype, x.itemsize) for x in m.layers] == \
        [(Kind.SPLIT, 8, (128, 128), "bfloat16", 2)] * 80
    assert m.layers == PRESETS["llama3-70b"].layers
    ds = {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_attention_heads": 128,
          "num_key_value_heads": 128, "torch_dtype": "bfloat16"}
    assert from_hf_config(ds).layers == PRESETS["deepseek-v3"].layers
    v32 = from_hf_config({**ds, "index_head_dim": 128, "index_n_heads": 64})  # MLA latent + fp8 indexer (+ scale)
    assert [(x.name, x.head_dims, x.itemsize) for x in v32.layers[:2]] == \
        [("layers.0", (576,), 2), ("layers.0.indexer", (132,), 1)]
    mm = from_hf_config({"text_config": {"num_hidden_layers": 2, "num_attention_heads": 8, "head_dim": 256,
                                         "num_key_value_heads": 4, "layer_types": ["sliding_attention",
                                                                                   "full_attention"]},
                         "torch_dtype": "float16"})
    assert [(x.total_heads, x.head_dims, x.dtype) for x in mm.layers] == [(4, (256, 256), "float16")] * 2
    per_layer = from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512,
                                "num_key_value_heads": [2, 4]}, dtype="fp8")
    assert [(x.total_heads, x.head_dims, x.itemsize) for x in per_layer.layers] == [(2, (64, 64), 1), (4, (64, 64), 1)]


@pytest.mark.parametrize("cfg, text", [
    ({"num_attention_heads": 8}, "num_hidden_layers"),
    ({"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 512}, "not a multiple"),
    ({"num_hidden_layers": 2, "num_attention_heads": 8, "head_dim": 64, "layer_types": ["linear_attention",
                                                                                      "full_attention"]},
     "'linear_attention'"),
    ({"num_hidden_layers": 2, "num_attention_heads": 8, "head_dim": 64, "num_key_value_heads": [2]}, "lists 1"),
    ({"num_hidden_layers": 2, "kv_lora_rank": 512}, "qk_rope_head_dim"),
    ({"num_hidden_layers": True, "num_attention_heads": 8, "head_dim": 64}, "num_hidden_layers"),
    ([1, 2], "JSON object"),
])
def test_hf_config_errors_name_the_key(cfg, text):
    with pytest.raises(RegionError, match=re.escape(text)):
        from_hf_config(cfg)


def test_presets_and_specs_match_the_sweeps():
    """The library's presets and rank specs are the sweep's (bench/presets.py builds them from
    meta tensors through Region): equal specs on every rank, so the plans are the same."""
    from bench import presets as sweep

    assert set(PRESETS) == set(sweep.PRESETS)
    for name, model in PRESETS.items():
        for tp in (1, 2, 8):
            for layout in ("HND", "NHD"):
                ours = rank_specs(model, tp - 1, tp, 40, 16, layout)
                theirs = sweep.specs_for(sweep.PRESETS[name], tp - 1, tp, 40, 16, sweep.Layout(layout))
                assert ours == theirs, (name, tp, layout)
                assert build_plan(0, tp, ours, 1, rank_specs(model, 0, 1, 40, 16)).digest() == \
                    build_plan(0, tp, theirs, 1, sweep.specs_for(sweep.PRESETS[name], 0, 1, 40, 16)).digest()


def test_baseline_formula_is_the_sweeps():
    from bench.baselines import vllm_direct_descriptor_count

    for args in [(1, 80, 512), (2, 32, 128, 2), (4, 61, 1, 1), (0, 3, 3)]:
        assert nixl_connector_descriptors(*args) == vllm_direct_descriptor_count(*args)


# ------------------------------------------------------------------------------------------ doctor
def test_doctor_reports_each_item(kvtriton):
    rc, out, err = kvtriton("doctor", "--json", timeout=180)
    assert rc == 0, out + err
    rep = json.loads(out)
    by_name = {c["name"]: c for c in rep["checks"]}
    assert rep["ok"] is True
    for name in ("python", "kvtriton", "numpy", "msgpack", "einops", "torch", "triton", "nixl", "NIXL backends",
                 "UCX transports", "CUDA devices", "PTX 16-byte check", "cost model (cpu)", "vLLM"):
        assert by_name[name]["status"] in ("ok", "missing"), name
    assert all(c["ok"] for c in rep["checks"] if c["required"])
    assert by_name["nixl"]["detail"].startswith(md.version("nixl"))
    assert "UCX" in by_name["NIXL backends"]["detail"]
    assert by_name["PTX 16-byte check"]["ok"] == bool(by_name["PTX 16-byte check"]["detail"].endswith("sm_90: ok"))
    assert by_name["cost model (cpu)"]["status"] == "missing"  # an empty cache
    assert "kvtriton costmodel --remeasure" in by_name["cost model (cpu)"]["fix"]
    path = _cache_file(kvtriton.cache)
    rc, text, _ = kvtriton("doctor", "--no-ptx", timeout=180)
    assert rc == 0 and text.strip().endswith("kvtriton doctor: ok")
    assert re.search(rf"ok\s+cost model \(cpu\)\s+{re.escape(str(path))} \(0\.\d h old\)", text), text


def test_doctor_exits_1_when_a_required_part_is_missing(kvtriton, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "msgpack.py").write_text("raise ImportError('msgpack removed by the test')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(broken)])}
    rc, out, _ = kvtriton("doctor", "--no-ptx", env=env, timeout=180)
    assert rc == 1
    assert re.search(r"missing\s+msgpack\s+cannot import msgpack: ImportError: msgpack removed", out), out
    assert "-> pip install msgpack" in out and out.strip().endswith("kvtriton doctor: missing: msgpack")


# ------------------------------------------------------------------------------------------ costmodel
def test_costmodel_shows_the_cached_model(kvtriton):
    path = _cache_file(kvtriton.cache, desc_us=1.25)
    rc, out, err = kvtriton("costmodel")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["desc_us"] == 1.25 and rep["cache"] == str(path) and rep["source"] == f"cached {path}"
    res = subprocess.run([sys.executable, "-m", "kvtriton.costmodel"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "KVTRITON_CACHE_DIR": str(kvtriton.cache),
                              "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0 and json.loads(res.stdout) == rep  # the old spelling: the same command
    rc, _, err = kvtriton("costmodel", "--bogus")
    assert rc == 2 and "--bogus" in err


@pytest.mark.nixl
def test_costmodel_remeasure_overwrites_the_cache(kvtriton):
    path = _cache_file(kvtriton.cache, desc_us=1.25)
    rc, out, err = kvtriton("costmodel", "--remeasure", timeout=300)
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["source"].startswith("measured ") and rep["cache"] == str(path)
    assert json.loads(path.read_text())["source"] == rep["source"]


# ------------------------------------------------------------------------------------------ packaging
def test_pins_are_the_tested_ranges():
    """pyproject pins what was tested, as doctor's TESTED states it; this venv's NIXL is inside."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    for name in ("nixl", "vllm"):
        lo, hi = TESTED[name]
        assert extras[name] == [f"{name}>={lo},<{hi}"]
    from kvtriton.cli.doctor import _in_range

    assert _in_range(md.version("nixl"), *TESTED["nixl"])
    assert not _in_range("1.5.2", *TESTED["nixl"]) and not _in_range("1.4.9", *TESTED["nixl"])
    assert _in_range("0.34.0", *TESTED["vllm"]) and not _in_range("0.35.0", *TESTED["vllm"])
    assert PYPROJECT["project"]["entry-points"]["vllm.general_plugins"] == {
        "kvtriton": "kvtriton.integrations.vllm.plugin:register"}


def test_every_package_is_installed():
    """``[tool.setuptools.packages.find]`` finds every package of the library and nothing else
    (a wheel holds only those: not beds/, tests/ or bench/)."""
    from setuptools import find_packages

    listed = set(find_packages(str(ROOT), **PYPROJECT["tool"]["setuptools"]["packages"]["find"]))
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kvtriton").rglob("__init__.py")}
    assert found == listed and "kvtriton.kernels" in listed
