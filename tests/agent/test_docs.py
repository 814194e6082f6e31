"""The examples users copy from the README, docs/*.md and the agent's docstring must run as written."""

import re
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


DOCS = sorted((ROOT / "docs").glob("*.md"))


def _runnable(page: Path) -> list[str]:
    """The page's python blocks, less those marked ``# sketch`` (shown, not run)."""
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    return [code for code in blocks if not code.startswith("# sketch")]


def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks
    runnable = [code for code in blocks if not code.startswith("# sketch")]
    assert runnable
    for code in runnable:
        exec(compile(code, "README.md", "exec"), {})


def test_docs_pages_exist():
    assert {p.name for p in DOCS} >= {"design.md", "vllm.md", "results.md", "operations.md"}


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_docs_python_examples_run(page):
    """Every runnable python block of docs/*.md runs as written (pages without one pass)."""
    for code in _runnable(page):
        exec(compile(code, f"docs/{page.name}", "exec"), {})


@pytest.mark.nixl
def test_agent_docstring_example_runs():
    pytest.importorskip("nixl")
    import kvtriton.agent as agent_module

    doc = agent_module.__doc__
    example = doc[doc.index("Two ranks in one process"):]
    example = textwrap.dedent(example[example.index("::") + 2:])
    exec(compile(example, "kvtriton/agent.py", "exec"), {})


@pytest.mark.nixl
def test_background_progress_thread():
    pytest.importorskip("nixl")
    import torch

    from kvtriton import Region
    from kvtriton.agent import TransferAgent

    k = torch.randn(8, 4, 2, 16)
    src = [Region.attention("l", k, k + 1, block_size=4, total_heads=2)]
    dst_k = torch.zeros(8, 4, 2, 16)
    dst = [Region.attention("l", dst_k, torch.zeros_like(dst_k), block_size=4, total_heads=2)]
    with TransferAgent("P", 0, 1, src, staging_bytes=64 << 10, impl="torch") as p, \
            TransferAgent("D", 0, 1, dst, staging_bytes=64 << 10, impl="torch") as d:
        d.add_remote(p.metadata())
        p.add_remote(d.metadata())
        p.start()
        d.start()
        p.hold("r", [1, 2])
        d.fetch("r", "P", [1, 2], [5, 6])
        deadline, res = time.monotonic() + 10, []
        while not res and time.monotonic() < deadline:
            res = d.results()
            time.sleep(0.001)
        assert res and res[0].ok
        assert torch.equal(dst_k[5:7].view(torch.uint8), k[1:3].view(torch.uint8))
