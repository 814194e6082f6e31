"""A decode step's loads finish without waiting for the prefill process (issue 36, point 2).

On real vLLM engines with 32 loads in flight, one load of a step finished in 36 ms and the other
31 together 1.4 s later (7.6-8.1 s in another cell): the wait was on the prefill's side. The
cause: the step issues its fetches one after another on the engine thread while the decode
agent's own thread progresses between them; a load that finishes there sends its source
RunsDone and Done, and a READ posted to a source after a message completes only at that
source's next progress (the UCX endpoint flush over TCP, :mod:`kvtriton.transport.fence`). The
prefill's agent thread, in a worker process on a shared core, came late, and every later load of
the step waited for it at once. ``WorkerSide.start_loads`` now issues a step's loads inside
``TransferAgent.batch()``: no progress in between, every READ posted before any message.

Here the prefill's agent progresses only while the test pumps it, and is stopped for the step:
every load must still finish (read from the prefill's offers, no pull), byte for byte.

Loads of *later* steps (a steady arrival rate) go out after earlier loads' RunsDone/Done reached
the prefill, so their READs wait for the prefill's UCX worker to progress whatever the batching:
its agents run NIXL's progress thread, sleeping on UCX's events (:mod:`kvtriton.transport.progress`),
which answers without the prefill's Python. Before it (progress from Python only) every load after
the first step waited for the prefill's next Python progress: 28 of 32 loads 324-465 ms p50 with
the prefill's agent progressing every 0.5 s (``bench/step_loads.py --steps 8 --no-nixl-thread``).
"""

import threading
import time

import pytest
from helpers.connector_bed import Bed

from kvtriton.integrations.vllm.scheduler import LoadSpec, RemoteSource, StepMessages

pytestmark = pytest.mark.nixl

LOADS = 12  # one block each; the bed's caches have 16


class Pump:
    """Progress the prefill's agent every millisecond while ``on`` (its own thread pauses an hour)."""

    def __init__(self, agent):
        self.agent, self.on, self.idle = agent, threading.Event(), threading.Event()
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop:
            if self.on.is_set():
                self.idle.clear()
                self.agent.progress()
                time.sleep(0.001)
            else:
                self.idle.set()
                time.sleep(0.001)

    def pause(self):
        self.on.clear()
        self.idle.wait(5)
        time.sleep(0.005)
        assert self.idle.is_set() and not self.on.is_set()

    def close(self):
        self.stop = True
        self.thread.join(5)


def _offered_and_paused(bed, pump, src):
    """The handshake and the first READs wired up, every request of ``src`` held and its offer
    received by the decode; then the prefill's agent stops progressing from Python."""
    pump.on.set()
    for i in range(3):  # the handshake, then UCX wires the first READs up with the prefill's help
        bed.hold(f"w{i}", [i])
        assert bed.load(f"w{i}", [i], [i], seconds=20.0) == (True, set())
    for i, s in enumerate(src):
        bed.hold(f"r{i}", [s])
    deadline = time.monotonic() + 20.0
    while not all(bed.decode.agent.has_offer("P", f"r{i}") for i in range(len(src))):
        assert time.monotonic() < deadline, "the prefill's offers never arrived"
        time.sleep(0.01)
    time.sleep(0.2)  # the decode's fences after its last messages land
    pump.pause()  # from here on the prefill never progresses from Python


def _step(bed, src, ids):
    """One decode step starting the loads ``ids`` (request i: prefill block src[i] -> decode block i)."""
    loads = {}
    for i in ids:
        rs = RemoteSource("P", "127.0.0.1", bed.port, 1, f"r{i}", (src[i],), 4)
        loads[f"d-r{i}"] = LoadSpec(f"d-r{i}", rs, (src[i],), (i,))
    bed.decode.bind(StepMessages(loads=loads))
    bed.decode.start_loads()
    bed.decode.clear()
    return set(loads)


def _finish(bed, want, seconds):
    done: set[str] = set()
    deadline = time.monotonic() + seconds
    while not want <= done and time.monotonic() < deadline:
        done |= bed.decode.finished()[1]
        time.sleep(0.005)
    assert not bed.decode.load_errors()
    return done


def test_a_steps_loads_finish_while_the_prefill_does_not_progress(gen):
    bed = Bed(gen, p_extra={"consumer": "D", "progress_interval_s": 3600.0}, d_extra={"progress_interval_s": 0.0})
    pump = Pump(bed.prefill.agent)
    try:
        src = [(5 * i + 1) % 16 for i in range(LOADS)]  # distinct prefill blocks, decode blocks 0..LOADS-1
        _offered_and_paused(bed, pump, src)
        fetch = bed.decode.agent.fetch

        def fetch_then_pause(*args, **kw):  # the engine thread is descheduled between two fetches
            fetch(*args, **kw)
            time.sleep(0.01)

        bed.decode.agent.fetch = fetch_then_pause
        want = _step(bed, src, range(LOADS))
        done = _finish(bed, want, 3.0)
        assert done == want, f"{LOADS - len(done)} of {LOADS} loads waited for the prefill's progress"
        bed.assert_landed(src, list(range(LOADS)))
        pump.on.set()  # RunsDone and Done reach the prefill: every hold ends
    finally:
        pump.close()
        bed.close()


def test_loads_of_later_steps_finish_while_the_prefill_does_not_progress(gen):
    """Three steps of four loads, each after the previous step's loads finished and their
    RunsDone/Done went to the prefill, whose agent never progresses from Python meanwhile: every
    load finishes within 1 s of its step, byte for byte."""
    bed = Bed(gen, p_extra={"consumer": "D", "progress_interval_s": 3600.0}, d_extra={"progress_interval_s": 0.0})
    pump = Pump(bed.prefill.agent)
    try:
        src = [(5 * i + 1) % 16 for i in range(LOADS)]
        _offered_and_paused(bed, pump, src)
        for k in range(0, LOADS, 4):
            want = _step(bed, src, range(k, k + 4))
            done = _finish(bed, want, 1.0)
            assert want <= done, f"step {k // 4}: {len(want - done)} of 4 loads waited for the prefill's progress"
            time.sleep(0.02)  # their RunsDone and Done are sent before the next step's READs
        bed.assert_landed(src, list(range(LOADS)))
        pump.on.set()
    finally:
        pump.close()
        bed.close()


def test_a_steps_loads_never_wait_for_the_agents_own_thread(gen):
    """While another thread holds the decode agent (its progress thread descheduled inside
    ``progress()``, say), a step's loads return at once: ``start_loads`` defers them
    (``TransferAgent.fetch(wait=False)``), the next holder starts them, and they land byte for byte.
    Before, ``start_loads`` waited for that thread (9-37 ms in loaded real-engine cells)."""
    from helpers.lock_holder import LockHolder

    bed = Bed(gen, p_extra={"consumer": "D"}, d_extra={"progress_interval_s": 0.001})
    try:
        bed.hold("w0", [0])
        assert bed.load("w0", [0], [0], seconds=20.0) == (True, set())  # met, the first READs wired up
        src = [3, 7, 9]
        for i, s in enumerate(src):
            bed.hold(f"r{i}", [s])
        holder = LockHolder(bed.decode.agent)
        try:
            t0 = time.monotonic()
            want = _step(bed, src, range(len(src)))
            assert time.monotonic() - t0 < 1.0, "start_loads waited for the agent's lock"
            assert bed.decode.agent.stats["deferred_fetches"] == len(src)
        finally:
            holder.release()
        assert _finish(bed, want, 10.0) == want
        bed.assert_landed(src, list(range(len(src))))
    finally:
        bed.close()


def test_a_restarted_engine_is_met_again_for_the_load_that_finds_it_gone_while_the_agent_is_held(gen):
    """The decode dropped a prefill that restarted; the next load comes while another thread holds
    the decode agent. Its fetch is not deferred blindly: the engine not met raises at once
    (``Destination.met``, read without the lock), the worker meets the new agent for this very load,
    and it lands byte for byte (deferred, it would have failed as a lost peer and been recomputed)."""
    from helpers.lock_holder import LockHolder

    bed = Bed(gen, d_extra={"progress_interval_s": 0.001})
    try:
        bed.hold("r1", [1, 2])
        assert bed.load("r1", [1, 2], [3, 4], seconds=20.0) == (True, set())
        old = bed.prefill.agent.transport.name
        bed.restart_prefill()  # same engine id and address, a new agent with new data
        deadline = time.monotonic() + 10.0
        while any(p["agent"] == old for p in bed.decode.agent.debug_state()["peers"].values()):
            assert time.monotonic() < deadline, "the decode never dropped the old prefill"
            time.sleep(0.01)
        bed.hold("r2", [5, 6])
        holder = LockHolder(bed.decode.agent)
        try:
            rs = RemoteSource("P", "127.0.0.1", bed.port, 1, "r2", (5, 6), 4)
            bed.decode.bind(StepMessages(loads={"d-r2": LoadSpec("d-r2", rs, (5, 6), (7, 8))}))
            t0 = time.monotonic()
            bed.decode.start_loads()
            bed.decode.clear()
            assert time.monotonic() - t0 < 1.0
            assert bed.decode.agent.stats["deferred_fetches"] == 0
        finally:
            holder.release()
        assert _finish(bed, {"d-r2"}, 10.0) == {"d-r2"}
        bed.assert_landed([5, 6], [7, 8])
    finally:
        bed.close()
