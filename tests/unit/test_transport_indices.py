"""The index check every post runs before NIXL sees the indices (a wrong index names another
block's descriptor, and NIXL's own check reads an int64 index as 32 bits): integers only, 1-D,
in range; int64 returned."""

import numpy as np
import pytest

from kvtriton.transport.handles import indices


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16])
def test_integer_indices_in_range_come_back_as_int64(dtype):
    got = indices(np.array([3, 0, 7], dtype=dtype), 8, "local_idx")
    assert got.dtype == np.int64 and got.tolist() == [3, 0, 7]
    assert indices([1, 2], 3, "remote_idx").tolist() == [1, 2]


@pytest.mark.parametrize("bad,error,words", [
    (np.array([0.0, 1.0]), TypeError, "must be integers"),
    (np.array([True, False]), TypeError, "must be integers"),
    (np.array([0, 8], dtype=np.int64), IndexError, "values in [0, 8] for a list of 8"),
    (np.array([-1, 2], dtype=np.int64), IndexError, "values in [-1, 2]"),
    (np.array([1 << 40], dtype=np.int64), IndexError, "values in [1099511627776, 1099511627776]"),  # NIXL: 0
    (np.array([3, 9], dtype=np.int32), IndexError, "values in [3, 9]"),
    (np.zeros((2, 2), dtype=np.int64), ValueError, "must be 1-D"),
])
def test_bad_indices_are_refused_naming_what_was_wrong(bad, error, words):
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        indices(bad, 8, "local_idx")
