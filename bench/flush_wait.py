"""How long a READ takes to complete after a message to its source, by how the source progresses
(issue 36 point 2; ``kvtriton/transport/progress.py``).

Two raw NIXL agents in one process: B sends A a notification, then READs 64 KiB from A while A's
Python never calls into NIXL. A runs without NIXL's progress thread (``--thread off``), or with it
and a ``poll()`` timeout of ``--wait-us`` between UCX events (NIXL's own Python API uses 0, a busy
loop). Also prints the CPU the process burns idle for 3 s with that setting.

    .venv/bin/python bench/flush_wait.py --thread off
    .venv/bin/python bench/flush_wait.py --thread on --wait-us 100000
    .venv/bin/python bench/flush_wait.py --thread on --wait-us 0        # as NixlConnector's agents
"""

from __future__ import annotations

import argparse
import resource
import time

import torch


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--thread", choices=["on", "off"], default="on")
    ap.add_argument("--wait-us", type=int, default=100_000,
                    help="the thread's poll() timeout (µs, >= 1000; 0: NIXL's own, a busy loop)")
    ap.add_argument("--tries", type=int, default=10)
    a = ap.parse_args()
    from nixl import _api as api

    from kvtriton.transport.progress import make_agent

    conf = api.nixl_agent_config(enable_prog_thread=a.thread == "on", backends=["UCX"])
    if a.wait_us == 0:  # NIXL's own setting: the thread busy-polls (what vLLM's NixlConnector runs)
        src_agent, on = api.nixl_agent("A", conf), a.thread == "on"
    else:
        src_agent, on = make_agent(api, "A", conf, a.wait_us)
    reader = api.nixl_agent("B", api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    src, dst = torch.arange(1 << 16, dtype=torch.uint8), torch.zeros(1 << 16, dtype=torch.uint8)
    src_agent.register_memory(src)
    reader.register_memory(dst)
    src_agent.add_remote_agent(reader.get_agent_metadata())
    reader.add_remote_agent(src_agent.get_agent_metadata())
    sd, dd = src_agent.get_xfer_descs(src), reader.get_xfer_descs(dst)

    def read(limit_s: float, help_source: bool) -> float:
        x = reader.initialize_xfer("READ", dd, sd, "A")
        t0 = time.monotonic()
        reader.transfer(x)
        while reader.check_xfer_state(x) == "PROC" and time.monotonic() - t0 < limit_s:
            if help_source:
                src_agent.get_new_notifs()
        ms = (time.monotonic() - t0) * 1e3
        reader.release_xfer_handle(x)
        return ms

    for _ in range(3):  # UCX wires the endpoint up, the source's Python helping
        read(5.0, help_source=True)
    c0, t0 = _cpu_s(), time.monotonic()
    time.sleep(3)
    idle = _cpu_s() - c0
    out = []
    for _ in range(a.tries):
        reader.send_notif("A", b"done")
        end = time.monotonic() + 0.01
        while time.monotonic() < end:
            reader.get_new_notifs()
        out.append(read(1.0, help_source=False))
        time.sleep(0.05)
    late = sum(ms >= 1000 for ms in out)
    print(f"source thread {'on, wait ' + str(a.wait_us) + ' us' if on else 'off'}: idle CPU {idle:.3f} s per "
          f"{time.monotonic() - t0 - sum(out) / 1e3 - 0.06 * a.tries:.1f} s; READ after a message (ms): "
          + " ".join(f"{ms:.2f}" for ms in out) + f"; {late} of {a.tries} not done in 1 s")


if __name__ == "__main__":
    main()
