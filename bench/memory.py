"""Peak memory of a bench and every process it starts, sampled from ``/proc`` while it runs.

Why sample: ``resource.getrusage`` gives the peak of this process and of the single largest
child it waited for, not what the process tree held at once (the quick cost-model grid once
peaked at 10 GB across its group processes; a pd_vllm run holds two engines and their TP workers).
A sampler process walks ``/proc`` every ``interval_s`` and keeps, over the sampled moments:

* ``tree_pss_gb``: the sum over this process and its descendants of PSS (proportional set
  size, ``/proc/<pid>/smaps_rollup``: a page shared by n processes counts 1/n in each, so the
  sum is what the tree holds, not each engine's copy of torch counted again); RSS where PSS
  cannot be read;
* ``largest_rss_gb``: the largest single process's RSS and its command (``largest``).

Linux only: elsewhere (no ``/proc``) the figures are ``None`` and say so. A short burst between
two samples can be missed: the figure is a lower bound on the true peak, close to it for
anything that holds its memory for longer than a sample (every bench here).
"""

from __future__ import annotations

if not __package__:  # `python bench/memory.py`: run as `python -m bench.memory` (bench/_as_module.py)
    import _as_module

    _as_module.run_as_module(__file__)

import json
import os
import subprocess
import sys
from pathlib import Path

GB = 1 << 30
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _children_map(proc: Path) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            # the command may hold spaces and parentheses: the fields after the last ')' are fixed
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone since the listing, or not ours to read
        kids.setdefault(ppid, []).append(int(d.name))
    return kids


def tree(root: int, proc: Path = Path("/proc"), skip: int | None = None) -> list[int]:
    """``root`` and every descendant now (``skip`` and its descendants left out)."""
    kids = _children_map(proc)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid == skip:
            continue
        out.append(pid)
        todo += kids.get(pid, [])
    return out


def _kib(text: str, field: str) -> int | None:
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def process_memory(pid: int, proc: Path = Path("/proc")) -> tuple[int, int] | None:
    """(pss, rss) bytes of ``pid`` now; PSS falls back to RSS where smaps_rollup is unreadable;
    None when the process is gone."""
    try:
        rss = int((proc / str(pid) / "statm").read_text().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return None
    try:
        pss = _kib((proc / str(pid) / "smaps_rollup").read_text(), "Pss")
    except OSError:
        pss = None
    return (rss if pss is None else pss * 1024), rss


def _command(pid: int, proc: Path = Path("/proc")) -> str:
    try:
        parts = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [Path(p.decode(errors="replace")).name if i == 0 else p.decode(errors="replace")
             for i, p in enumerate(parts[:3]) if p]
    return " ".join(words)[:60]


class PeakMemory:
    """``with PeakMemory() as m: ...``; then ``m.figures()``. Samples the tree of ``root`` (this
    process by default) every ``interval_s`` from a sampler process of its own (``python
    bench/memory.py``): a thread here would hold this process's GIL for the ~30 ms a walk of
    /proc takes on a busy host, in the middle of the in-process benchmarks it measures. The sampler
    leaves itself out of the tree and samples once more when told to stop."""

    def __init__(self, interval_s: float = 1.0, root: int | None = None, proc: Path = Path("/proc")):
        self.interval_s, self.root, self.proc = interval_s, root or os.getpid(), proc
        self.tree_pss = 0
        self.largest_rss, self.largest = 0, ""
        self.samples = 0
        self._sampler: subprocess.Popen | None = None
        self._figures: dict | None = None

    def sample(self, skip: int | None = None) -> None:
        """One walk of the tree now (``skip``: a pid left out with its descendants)."""
        total, big, who = 0, 0, 0
        for pid in tree(self.root, self.proc, skip):
            mem = process_memory(pid, self.proc)
            if mem is None:
                continue
            total += mem[0]
            if mem[1] > big:
                big, who = mem[1], pid
        self.samples += 1
        self.tree_pss = max(self.tree_pss, total)
        if big > self.largest_rss:
            self.largest_rss, self.largest = big, _command(who, self.proc)

    def __enter__(self) -> PeakMemory:
        if self.proc.is_dir():
            self._sampler = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(self.root), str(self.interval_s), str(self.proc)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            # the section starts once the sampler runs: a start-up slower than the section (a loaded
            # host) would otherwise miss what it did; bounded, a silent sampler is reported at exit
            import select

            if select.select([self._sampler.stdout], [], [], 60)[0]:
                self._sampler.stdout.readline()
        return self

    def __exit__(self, *exc) -> None:
        if self._sampler is None:
            return
        try:
            out, _ = self._sampler.communicate("", timeout=60)  # stdin closed: last sample, figures, exit
            self._figures = json.loads(out.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            self._sampler.kill()
            self._sampler.wait(timeout=10)
            self._figures = {"tree_pss_gb": None, "largest_rss_gb": None, "largest": "sampler failed"}

    def figures(self) -> dict:
        """``tree_pss_gb``, ``largest_rss_gb`` (None without /proc), ``largest`` (its command)."""
        if self._figures is not None:
            return self._figures
        if not self.samples:
            return {"tree_pss_gb": None, "largest_rss_gb": None, "largest": "no /proc: not measured"}
        return {"tree_pss_gb": round(self.tree_pss / GB, 2), "largest_rss_gb": round(self.largest_rss / GB, 2),
                "largest": self.largest}


def _sampler_main(root: int, interval_s: float, proc: str) -> None:
    """The sampler process: sample every ``interval_s`` until stdin closes, then print the figures."""
    import select

    m = PeakMemory(interval_s, root, Path(proc))
    first = True
    while True:
        try:
            m.sample(skip=os.getpid())
        except OSError:  # /proc raced with an exiting process: the next sample sees the rest
            pass
        if first:
            print("sampling", flush=True)  # PeakMemory.__enter__ waits for it
            first = False
        ready, _, _ = select.select([sys.stdin], [], [], interval_s)
        if ready and not sys.stdin.read(1):
            break
    m.sample(skip=os.getpid())
    print(json.dumps(m.figures()), flush=True)


if __name__ == "__main__":
    _sampler_main(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3])
