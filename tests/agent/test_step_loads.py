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


def test_a_steps_loads_finish_while_the_prefill_does_not_progress(gen):
    bed = Bed(gen, p_extra={"consumer": "D", "progress_interval_s": 3600.0}, d_extra={"progress_interval_s": 0.0})
    pump = Pump(bed.prefill.agent)
    try:
        pump.on.set()
        for i in range(3):  # the handshake, then UCX wires the first READs up with the prefill's help
            bed.hold(f"w{i}", [i])
            assert bed.load(f"w{i}", [i], [i], seconds=20.0) == (True, set())
        src = [(5 * i + 1) % 16 for i in range(LOADS)]  # distinct prefill blocks, decode blocks 0..LOADS-1
        for i, s in enumerate(src):
            bed.hold(f"r{i}", [s])
        deadline = time.monotonic() + 20.0
        while not all(bed.decode.agent.has_offer("P", f"r{i}") for i in range(LOADS)):
            assert time.monotonic() < deadline, "the prefill's offers never arrived"
            time.sleep(0.01)
        time.sleep(0.2)  # the decode's fences after its last messages land
        pump.pause()  # from here on the prefill never progresses

        loads = {}
        for i, s in enumerate(src):
            rs = RemoteSource("P", "127.0.0.1", bed.port, 1, f"r{i}", (s,), 4)
            loads[f"d-r{i}"] = LoadSpec(f"d-r{i}", rs, (s,), (i,))
        fetch = bed.decode.agent.fetch

        def fetch_then_pause(*args, **kw):  # the engine thread is descheduled between two fetches
            fetch(*args, **kw)
            time.sleep(0.01)

        bed.decode.agent.fetch = fetch_then_pause
        bed.decode.bind(StepMessages(loads=loads))
        bed.decode.start_loads()
        bed.decode.clear()
        done: set[str] = set()
        deadline = time.monotonic() + 3.0
        while len(done) < LOADS and time.monotonic() < deadline:
            done |= bed.decode.finished()[1]
            time.sleep(0.005)
        assert not bed.decode.load_errors()
        assert done == set(loads), f"{LOADS - len(done)} of {LOADS} loads waited for the prefill's progress"
        bed.assert_landed(src, list(range(LOADS)))
        pump.on.set()  # RunsDone and Done reach the prefill: every hold ends
    finally:
        pump.close()
        bed.close()
