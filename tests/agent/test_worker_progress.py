"""The connector's worker progresses its agent on the engine's own thread, once per step.

Why: a decode engine waiting for loads runs its steps back to back in Python, so the agent's
background thread gets the interpreter only every ``sys.getswitchinterval()`` (5 ms), once per
protocol hop (a 3.6 ms load took 16 ms on real engines). Here the decode's background thread
pauses an hour between polls: a load finishes only if ``finished()`` (vLLM's ``get_finished``,
every step) progresses the agent itself. The bytes are checked against the prefill's blocks.
"""

import time

import pytest
from helpers.connector_bed import Bed

from kvtriton.integrations.vllm.scheduler import StepMessages

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



def _start(bed, rid, remote, local, idle):
    """Bind and start one load in a step that is ``idle`` (no tokens scheduled) or not."""
    from kvtriton.integrations.vllm.scheduler import LoadSpec, RemoteSource

    req = f"w-{rid}"
    src = RemoteSource(bed.engine, "127.0.0.1", bed.port, 1, rid, tuple(remote), 4)
    bed.decode.bind(StepMessages(loads={req: LoadSpec(req, src, tuple(remote), tuple(local))}, idle=idle))
    bed.decode.start_loads()
    return req


def test_an_idle_step_reports_its_load_in_the_same_step(gen):
    """A step with no tokens scheduled (``idle``) waits in ``finished()`` up to ``idle_wait_s``
    for its loads: the load it started is reported by that step's own ``get_finished``, one
    engine step sooner. Bytes checked against the prefill's blocks."""
    bed = Bed(gen, d_extra={"progress_interval_s": 3600.0, "idle_wait_s": 0.1})
    try:
        bed.hold("r0", [1, 2])
        assert bed.load("r0", [1, 2], [3, 4], seconds=20.0)[0]  # the handshake, first use
        bed.hold("r1", [3, 7, 8, 2])
        req = _start(bed, "r1", [3, 7, 8, 2], [0, 5, 6, 9], idle=True)
        _, recving = bed.decode.finished()
        bed.decode.clear()
        assert req in recving and not bed.decode.load_errors()
        bed.assert_landed([3, 7, 8, 2], [0, 5, 6, 9])
    finally:
        bed.close()


def test_the_idle_wait_is_bounded_and_never_in_a_step_with_a_forward(gen):
    """A load that cannot land (its prefill's agent never progresses, so its pull is never
    answered) holds an idle step for ``idle_wait_s`` and no longer; a step that runs a forward
    (tokens scheduled) does not wait at all."""
    bed = Bed(gen, p_extra={"progress_interval_s": 3600.0, "eager_guess": False},
              d_extra={"idle_wait_s": 0.1, "timeout_s": 30.0})
    try:
        bed.hold("r1", [3, 7])
        req = _start(bed, "r1", [3, 7], [0, 5], idle=False)
        deadline = time.monotonic() + 20
        while not bed.decode.agent.debug_state()["fetches"] and time.monotonic() < deadline:
            time.sleep(0.01)  # the handshake (its own thread) ends and the fetch starts
        t0 = time.monotonic()
        _, recving = bed.decode.finished()
        busy_s = time.monotonic() - t0
        bed.decode.clear()
        bed.decode.bind(StepMessages(idle=True))
        t0 = time.monotonic()
        _, recving2 = bed.decode.finished()
        idle_s = time.monotonic() - t0
        bed.decode.clear()
        assert req not in recving | recving2
        assert idle_s >= 0.1 and busy_s < idle_s, (busy_s, idle_s)
    finally:
        bed.close()


def test_a_step_is_idle_only_when_no_tokens_are_scheduled():
    """The scheduler side marks a step idle from vLLM's ``total_num_scheduled_tokens`` (0: no
    forward); an output without the field is never idle (the workers then never wait)."""
    from types import SimpleNamespace

    from kvtriton.integrations.vllm.scheduler import SchedulerSide

    side = SchedulerSide(engine_id="D", host="127.0.0.1", port=1, tp_size=1, block_size=4)
    assert side.build_messages(SimpleNamespace(total_num_scheduled_tokens=0)).idle
    assert not side.build_messages(SimpleNamespace(total_num_scheduled_tokens=3)).idle
    assert not side.build_messages(SimpleNamespace()).idle
