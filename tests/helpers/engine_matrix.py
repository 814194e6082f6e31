"""Which cases of a real-engine test CI runs, and which the benchmark adds (issue 36: "a full
matrix belongs in the benchmark, not in CI"). A case moves to the benchmark only where another
CI case checks the same oracles on the same path; the test module says which and why. The
benchmark's runner (``bench/vllm_matrix.py``) sets :data:`ENV` and runs the same test functions,
so a moved case keeps every check it had."""

import os

ENV = "KVTRITON_ENGINE_MATRIX"  # "full": every case; unset: CI's


def cases(ci: list, bench: list) -> list:
    """``ci``, with ``bench`` after it when :data:`ENV` is ``full``."""
    return ci + bench if os.environ.get(ENV) == "full" else ci
