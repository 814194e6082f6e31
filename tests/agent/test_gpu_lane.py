"""What can be checked of the GPU lane without a GPU: the width of the kernels' compiled global
accesses (Triton compiles for sm_90 on any machine), and bench/gpu_check.sh's dry run.

The same PTX check runs in ``make test`` under the oldest Triton we check (.venv-triton36), and on
the GPU machine as step 3 of gpu_check.sh.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVTRITON_IMPL")}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when it is unset
    return {**env, **extra}


def test_kernels_compile_to_16_byte_accesses():
    """Both kernels, compiled for sm_90, copy with 16-byte loads and stores on the cache and the
    staging side. A dropped or misplaced alignment hint compiles fine and runs correctly, just at a
    fraction of the bandwidth."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "ptx_check.py")], env=_env(), capture_output=True,
                         text=True, timeout=300)
    if res.returncode == 2:
        pytest.skip(res.stdout.strip().splitlines()[-1])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "_pack_kernel" in res.stdout and "_unpack_kernel" in res.stdout


def _throwaway_python(venv: Path) -> str:
    """A venv that sees this interpreter's packages (a .pth naming its site-packages) but keeps its
    own installs: gpu_check.sh installs the checkout editable, and into the running venv that would
    repoint its kvtriton at this checkout (a deleted worktree's, once, broke a developer's venv)."""
    import site
    import venv as venv_mod

    venv_mod.create(venv, with_pip=False)
    py = venv / "bin" / "python"
    ours = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    # pip comes from the parent's site-packages through the .pth; the install lands in `ours`
    Path(ours, "parent.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return str(py)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a dry run needs a machine without CUDA")
def test_gpu_check_dry_run(tmp_path):
    """gpu_check.sh without a GPU: versions, the no-index install and the PTX check run and pass,
    then it stops with 'no CUDA device' and exit status 2, its logs under $OUT."""
    res = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], cwd=ROOT, capture_output=True, text=True,
                         env=_env(OUT=str(tmp_path), PY=_throwaway_python(tmp_path / "venv"), PIP_NO_INDEX="1"),
                         timeout=400)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "no CUDA device" in out.strip().splitlines()[-1], out
    status = (tmp_path / "status.txt").read_text()
    for step in ("versions", "install", "ptx"):
        assert f"[{step}] ok" in status, status
    assert "[tests]" not in status and "[sweep]" not in status
    log = (tmp_path / "gpu_check.log").read_text()
    assert f"torch {torch.__version__}" in log and "kvtriton from" in log and "ptx_check: Triton" in log


_BUNDLE_CHECK = r"""
import sys, time, numpy as np, torch
from kvtriton.transport.nixl import NixlTransport, XferStatus
import nixl, nixl._api
site = sys.argv[1]
assert nixl.__file__.startswith(site) and nixl._api.__file__.startswith(site), (nixl.__file__, nixl._api.__file__)
src = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
dst = torch.zeros_like(src)
with NixlTransport("bundle-a") as a, NixlTransport("bundle-b") as b:
    a.register([dst]), b.register([src])
    peer = a.add_remote(b.metadata())
    loc = a.prep_local(np.array([[dst.data_ptr(), src.numel(), 0]]), "DRAM")
    rem = a.prep_remote(peer, np.array([[src.data_ptr(), src.numel(), 0]]), "DRAM")
    x = a.post("READ", loc, [0], rem, [0], b"")
    deadline = time.monotonic() + 60  # the first transfer wires up UCX: ms here, longer on a loaded machine
    while a.poll(x) is not XferStatus.DONE and time.monotonic() < deadline:
        b.poll_notifs()
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8)), "bytes differ"
    outside = sorted({m for m in (l.split()[-1] for l in open("/proc/self/maps") if "nixl" in l)
                      if not m.startswith(site)})
    assert not outside, f"NIXL libraries loaded from outside the bundle: {outside}"
print("bundle ok")
"""


@pytest.mark.nixl
def test_nixl_bundle_loads_nixl_from_itself(tmp_path):
    """scripts/nixl_bundle.py trims the installed NIXL (here: offline, from site-packages; for the
    GPU machine the same from downloaded cp312 wheels) to the UCX backend and what it loads; NIXL
    imported from the unpacked bundle alone moves bytes, and loads no library from elsewhere."""
    nixl = pytest.importorskip("nixl", reason="builds the bundle from the installed NIXL")
    site = Path(nixl.__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "nixl_bundle.py"), "--from-site", str(site),
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    (tarball,) = tmp_path.glob("nixl-*-cp*-cu*.tar.xz")
    assert tarball.stat().st_size < 16 << 20, res.stdout  # the wheel: ~59 MB
    unpacked = tmp_path / "site"
    with tarfile.open(tarball) as tar:  # as bench/gpu_check.sh unpacks it
        tar.extractall(unpacked, filter="data")
    names = {p.name for p in unpacked.rglob("*.so*")}
    assert "libplugin_UCX.so" in names and not any(n.startswith("libplugin_") and n != "libplugin_UCX.so"
                                                   for n in names)
    assert any(n.startswith("libuct_cuda.") for n in names)
    res = subprocess.run([sys.executable, "-c", _BUNDLE_CHECK, str(unpacked)], capture_output=True, text=True,
                         timeout=120, env=_env(PYTHONPATH=str(unpacked)))
    assert res.returncode == 0 and "bundle ok" in res.stdout, res.stdout + res.stderr
