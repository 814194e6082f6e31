"""The sweep's output format: long-form rows with p20/p50/p80, the cost-model summary line."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))


def test_long_rows_one_row_per_metric_with_quantiles():
    from sweep import long_rows

    rows = [dict(section="e2e", case="c", transport="tcp", bytes=64, method="m", descriptors=3, ms=2.0,
                 ms_p20=1.5, ms_p80=2.5, gbps="", note="")]
    got = {r["metric"]: r for r in long_rows(rows)}
    assert set(got) == {"descriptors", "ms"}  # an empty gbps is no measurement
    assert (got["ms"]["p20"], got["ms"]["p50"], got["ms"]["p80"], got["ms"]["unit"]) == (1.5, 2.0, 2.5, "ms")
    assert (got["descriptors"]["p20"], got["descriptors"]["p80"], got["descriptors"]["unit"]) == (3, 3, "count")
    for r in got.values():  # parameters stay columns of every long row
        assert (r["section"], r["case"], r["transport"], r["bytes"], r["method"]) == ("e2e", "c", "tcp", 64, "m")


def test_costmodel_summary_line():
    from costgrid import summary_line

    rows = [dict(ratio=1.0), dict(ratio=1.2), dict(ratio=1.05), dict(transport="tcp", chosen="failed")]
    assert summary_line(rows) == "cost model: chosen/best worst 1.20, median 1.05 over 3 cells"
    assert summary_line([]) == "cost model: no cells ran"
    from costgrid import noise_line

    rows[1]["miss_beyond_noise"] = "yes"
    assert noise_line(rows).endswith("1 of 3 cells, worst 1.20")


def test_quantiles_of():
    from timing import qfields, quantiles_of

    assert quantiles_of([5.0]) == (5.0, 5.0, 5.0)
    q = quantiles_of([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert q == pytest.approx((2.0, 3.5, 5.0))
    assert qfields("ms", q, 1) == {"ms": 3.5, "ms_p20": 2.0, "ms_p80": 5.0}
