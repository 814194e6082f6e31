"""The connector's worker progresses its agent on the engine's own thread, once per step.

Why: a decode engine waiting for loads runs its steps back to back in Python, so the agent's
background thread gets the interpreter only every ``sys.getswitchinterval()`` (5 ms), once per
protocol hop (a 3.6 ms load took 16 ms on real engines). Here the decode's background thread
pauses an hour between polls: a load finishes only if ``finished()`` (vLLM's ``get_finished``,
every step) progresses the agent itself. The bytes are checked against the prefill's blocks.
"""

import pytest
from test_connector_trust import Bed  # tests/ is on sys.path

pytestmark = pytest.mark.nixl


def test_a_load_finishes_through_the_step_calls_alone(gen):
    bed = Bed(gen, d_extra={"progress_interval_s": 3600.0})
    try:
        bed.hold("r1", [3, 7, 8, 2])
        done, errors = bed.load("r1", [3, 7, 8, 2], [0, 5, 6, 9], seconds=20.0)
        assert done and not errors
        bed.assert_landed([3, 7, 8, 2], [0, 5, 6, 9])
    finally:
        bed.close()

