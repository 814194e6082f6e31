"""A deferred fetch keeps its own copy of the caller's ids (the caller may reuse its arrays once
``fetch(wait=False)`` returned), and names the local blocks it leaves undefined."""

import numpy as np
import torch

from kvtriton.agent.destination.deferred import DeferredFetch, local_blocks


def test_every_id_container_is_copied():
    src_np, src_t, flat, groups = np.array([4, 5]), torch.tensor([6, 7]), [1, 2], [[8, 9], np.array([3])]
    for ids in (src_np, src_t, flat, groups):
        d = DeferredFetch.of("r", "P", ids, ids, None, None, None)
        assert d.remote_block_ids is not ids and d.local_block_ids is not ids
    d = DeferredFetch.of("r", "P", src_np, groups, None, None, None)
    src_np[:] = 0
    groups[0][0] = 0
    groups[1][0] = 0
    assert d.remote_block_ids.tolist() == [4, 5]
    assert [list(map(int, g)) for g in d.local_block_ids] == [[8, 9], [3]]
    t = DeferredFetch.of("r", "P", src_t, flat, None, None, None)
    src_t[0] = 0
    flat[0] = 0
    assert t.remote_block_ids.tolist() == [6, 7] and t.local_block_ids == [1, 2]


def test_local_blocks_left_undefined_are_the_caches_own():
    assert local_blocks([5, -1, 48, 7], 48) == (5, 7)
    assert local_blocks([[1, 2, 3], [4]], 48) == (1, 2, 3, 4)  # one list per KV cache group, ragged
    assert local_blocks(np.array([[0, 1], [2, -1]]), 48) == (0, 1, 2)
    assert local_blocks(["a"], 48) == ()
