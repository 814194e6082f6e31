"""TransferAgent: the API serving code calls, one per rank (shaped like a KV connector's worker).

The agent is a facade (:mod:`.facade`: handshake, progress loop, message dispatch) over two
roles that own their own state: the source side (:mod:`.source`, composed of holds, the
staging share, serves per flow, eager packs and packing: serving transfers, pack, announce or
WRITE, release) and the destination side (:mod:`.destination`: fetches, READ or grants,
unpack, ack, finish or fail), sharing the peer links (:mod:`.links`), one :mod:`.settings`,
one :mod:`.plan_book` (every plan this rank serves or reads by), typed :mod:`.stats` and the
CUDA side (:mod:`.device`). :meth:`TransferAgent.debug_state` is a plain
snapshot of all of it for tests and operators (:mod:`.debug` documents its keys).

A prefill rank ``hold()``s a request's blocks; a decode rank ``fetch()``es them. Everything moves
when somebody calls :meth:`TransferAgent.progress` (non-blocking; call it from the engine's step
loop, or start the optional background thread with :meth:`TransferAgent.start`).

Pull (default): the decode rank sends ``pull`` to each source rank of its plan; the source packs
a chunk of its staged payload into a staging slot run and answers ``ready``; the decode rank READs
it (one descriptor), unpacks it into its cache and answers ``ack`` so the source reuses the slots
for the next chunk (two chunks in flight per transfer: pack i+1 while i is on the wire). DIRECT
regions are READ straight from the source's cache in coalesced block runs, once the source has
confirmed (:class:`~kvtriton.protocol.wire.RunsReady`) that it holds those blocks; a held request does not expire while a
transfer is reading it (the transfer has its own silence deadline), but never outlives its lease
plus ``timeout_s``; a decode rank renews the holds of its outstanding fetches. When everything has
landed the decode rank sends ``done`` to *every* rank of the source engine (replicas it skipped
included), and each source rank frees the request once all decode ranks are done or its lease
expires. A hold belongs to one consumer engine (see :mod:`.source.holds`): no other peer can read,
complete or renew it. A hold that names its consumer is packed ahead of the pull
(:mod:`.source.eager`) and offered to the consumer's ranks (``offer``): a fetch asking exactly that
READs at once, without a pull; a pull that comes first is answered with ``ready`` at once.

Push: the decode rank sends ``push`` and ``grant``s staging slots of its own; the source packs and
WRITEs each chunk into the granted slots with a ``data`` notification, and WRITEs DIRECT regions
straight into the decode rank's cache (:class:`~kvtriton.protocol.wire.RunsReady` notification).

Failures are per request: a dead peer, a rejection or a deadline makes :meth:`results` report a
typed error for that request only; staging is reclaimed, other requests go on.

Example
-------
Two ranks in one process (real NIXL over UCX; in production each rank is its own process)::

    import numpy as np, torch
    from kvtriton import Region
    from kvtriton.agent import TransferAgent

    def cache(heads):
        k = torch.randn(32, 16, heads, 64, dtype=torch.bfloat16)
        return [Region.attention("layer.0", k, torch.randn_like(k), block_size=16, total_heads=4)]

    prefill = TransferAgent("P", rank=0, tp=1, regions=cache(4), staging_bytes=4 << 20)
    decode = TransferAgent("D", rank=0, tp=2, regions=cache(2), staging_bytes=4 << 20)
    decode.add_remote(prefill.metadata()); prefill.add_remote(decode.metadata())
    prefill.hold("req-1", block_ids=[3, 4, 5], lease_s=30)
    decode.fetch("req-1", "P", remote_block_ids=[3, 4, 5], local_block_ids=[0, 1, 2])
    while not (res := decode.results()):
        prefill.progress(); decode.progress()
    assert res[0].ok
"""

from .destination import RequestResult
from .facade import TransferAgent
from .source import FreedRequest

__all__ = ["TransferAgent", "RequestResult", "FreedRequest"]
