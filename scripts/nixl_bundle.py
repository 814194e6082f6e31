#!/usr/bin/env python3
"""Build a trimmed NIXL bundle for a machine that has no NIXL and no network (the lent GPU
machine: see README, GPU), small enough to travel with the working tree.

NIXL's CUDA wheel (``nixl-cuNN``, pulled in by the ``nixl`` meta package) is ~59 MB compressed,
~250 MB installed: every backend plugin (GDS, object stores, libfabric, ...), their cloud SDKs,
InfiniBand libraries and the ``nixl_ep`` extension. kvtriton uses only the UCX backend. The
bundle keeps, with the wheel's own relative layout (the libraries find each other through
their ``$ORIGIN`` RPATHs, libnixl finds its plugins in ``plugins/`` beside it, and UCX finds its
modules in ``ucx/`` beside libucs, named with libucs's own ``.so.X.Y.Z`` suffix):

* the Python packages ``nixl`` (meta), ``nixl_meta_utils`` and ``nixl_cuNN``;
* the UCX backend plugin ``libplugin_UCX.so`` and the UCX modules for device memory between
  processes (``libuct_cuda``: cuda_ipc and cuda_copy; ``libucm_cuda``) and host memory
  (``libuct_cma``);
* every library those need, found by following ``DT_NEEDED`` through the wheel's library
  directories (libnixl needs gRPC and etcd's client even when neither is used). Libraries
  outside the wheel (glibc, libstdc++, OpenSSL, zlib, the CUDA driver's libcuda and
  libnvidia-ml, and libcudart.so.13, which torch's CUDA wheels load first) must be on the target.

Output: ``OUT/nixl-<version>-<pytag>-cu<NN>.tar.xz`` (``--format tar``, default) or that
directory (``--format dir``), a ``site`` folder to put on ``PYTHONPATH``, with ``BUNDLE.txt``
listing what it holds. Sources:

* default: ``pip download`` of ``nixl==V`` and ``nixl-cuNN==V`` for ``--python`` (the lent
  machine runs 3.12: ``cp312`` wheels), V the installed nixl's version unless ``--version``;
* ``--from-site DIR``: the files of an installed NIXL in site-packages ``DIR`` (offline; the
  tests build a bundle this way and load NIXL from it).

  usage: python scripts/nixl_bundle.py [--python 3.12] [--cuda 13] [--out .nixl]
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
UCX_MODULES = ("libuct_cuda.", "libucm_cuda.", "libuct_cma.")  # prefixes, in nixl_cuNN.libs/ucx
CARRY_LIMIT = 64 << 20  # the device tool's limit for the working tree and carried paths together


class Source:
    """The files of a NIXL install, by path relative to site-packages: a wheel pair or a site."""

    def __init__(self, files: dict[str, callable]):
        self.files = files  # relpath -> () -> bytes

    @classmethod
    def from_wheels(cls, wheels: list[Path]) -> Source:
        files = {}
        for w in wheels:
            z = zipfile.ZipFile(w)
            for name in z.namelist():
                if not name.endswith("/"):
                    files[name] = (lambda z=z, name=name: z.read(name))
        return cls(files)

    @classmethod
    def from_site(cls, site: Path) -> Source:
        files = {}
        for top in site.iterdir():
            if top.name.startswith(("nixl", ".nixl")):
                for p in ([top] if top.is_file() else top.rglob("*")):
                    if p.is_file():
                        files[str(p.relative_to(site))] = (lambda p=p: p.read_bytes())
        return cls(files)

    def read(self, rel: str) -> bytes:
        return self.files[rel]()


def needed(elf: bytes) -> list[str]:
    """The DT_NEEDED names of an ELF shared object (readelf, from binutils)."""
    with tempfile.NamedTemporaryFile() as f:
        f.write(elf)
        f.flush()
        out = subprocess.run(["readelf", "-d", f.name], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines() if "(NEEDED)" in line]


def select(src: Source, cuda: str) -> tuple[list[str], set[str]]:
    """The relative paths the bundle keeps, and the libraries it expects on the target."""
    pkg, meson, libs = f"nixl_cu{cuda}", f".nixl_cu{cuda}.mesonpy.libs", f"nixl_cu{cuda}.libs"
    if not any(p.startswith(pkg + "/") for p in src.files):
        raise SystemExit(f"nixl_bundle: no {pkg}/ in the source: is nixl-cu{cuda} installed / downloaded?")
    keep = {p for p in src.files
            if (p.startswith(("nixl/", pkg + "/")) or p == "nixl_meta_utils.py") and "__pycache__" not in p}
    roots = [p for p in keep if p.endswith(".so")]
    roots.append(f"{meson}/plugins/libplugin_UCX.so")
    roots += [p for p in src.files if p.startswith(f"{libs}/ucx/") and Path(p).name.startswith(UCX_MODULES)
              and ".so" in p]
    dirs = {meson, libs, f"{libs}/ucx"}  # where the RPATHs ($ORIGIN/...) of these libraries point
    by_name = {Path(p).name: p for p in src.files if str(Path(p).parent) in dirs and ".so" in Path(p).name}
    system, seen, todo = set(), set(), list(roots)
    while todo:  # follow DT_NEEDED from the roots; what the wheel does not hold is the target's
        p = todo.pop()
        if p in seen:
            continue
        if p not in src.files:
            raise SystemExit(f"nixl_bundle: {p} is not in the source (a different wheel layout?)")
        seen.add(p)
        for n in needed(src.read(p)):
            if n in by_name:
                todo.append(by_name[n])
            else:
                system.add(n)
    keep |= seen
    return sorted(keep), system


def download(version: str, python: str, cuda: str, into: Path) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           python, "--implementation", "cp", "-d", str(into)]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    subprocess.run(cmd + [f"nixl=={version}", f"nixl-cu{cuda}=={version}"], check=True)
    return sorted(into.glob("*.whl"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default="3.12", help="target Python (default 3.12, the lent GPU machine's)")
    ap.add_argument("--cuda", default="13", help="CUDA major of the target's torch (default 13: torch +cu130)")
    ap.add_argument("--version", help="NIXL version (default: the installed one)")
    ap.add_argument("--from-site", type=Path, help="take the files of an installed NIXL in this site-packages")
    ap.add_argument("--out", type=Path, default=Path(".nixl"))
    ap.add_argument("--format", choices=("tar", "dir"), default="tar")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        if args.from_site:
            src = Source.from_site(args.from_site)
            pytag = f"cp{sys.version_info.major}{sys.version_info.minor}"
            version = args.version or _installed_version()
        else:
            version = args.version or _installed_version()
            src = Source.from_wheels(download(version, args.python, args.cuda, Path(tmp)))
            pytag = "cp" + args.python.replace(".", "")
        keep, system = select(src, args.cuda)
        name = f"nixl-{version}-{pytag}-cu{args.cuda}"
        total = sum(len(src.read(p)) for p in keep)
        manifest = (f"NIXL {version} for {pytag}, CUDA {args.cuda}: UCX backend only ({len(keep)} files, "
                    f"{total / 2**20:.1f} MiB)\nexpected on the target: {' '.join(sorted(system))}\n"
                    + "".join(f"{len(src.read(p)):>10} {p}\n" for p in keep))
        args.out.mkdir(parents=True, exist_ok=True)
        if args.format == "dir":
            dest = args.out / name
            shutil.rmtree(dest, ignore_errors=True)
            for p in keep:
                (dest / p).parent.mkdir(parents=True, exist_ok=True)
                (dest / p).write_bytes(src.read(p))
            (dest / "BUNDLE.txt").write_text(manifest)
        else:
            dest = args.out / f"{name}.tar.xz"
            with tarfile.open(dest, "w:xz", preset=6) as tar:
                for p in keep + ["BUNDLE.txt"]:
                    data = manifest.encode() if p == "BUNDLE.txt" else src.read(p)
                    info = tarfile.TarInfo(p)
                    info.size, info.mode = len(data), 0o755 if ".so" in p else 0o644
                    tar.addfile(info, io.BytesIO(data))
        size = dest.stat().st_size if dest.is_file() else sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"nixl_bundle: {dest}: {size / 2**20:.1f} MiB ({total / 2**20:.1f} MiB unpacked, {len(keep)} files; "
          f"the device tool carries at most {CARRY_LIMIT >> 20} MiB with the working tree)")
    print(f"nixl_bundle: needs on the target: {' '.join(sorted(system))}")
    return 0 if size < CARRY_LIMIT else 1


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nixl")
    except PackageNotFoundError:
        raise SystemExit("nixl_bundle: no nixl installed here: give --version") from None


if __name__ == "__main__":
    sys.exit(main())
