import numpy as np
import pytest

from tnt_core import (
    ShardContext,
    ShardingError,
    micro_batch_offset,
    micro_batch_size,
    micro_batch_sizes,
    micro_batch_slice,
)


@pytest.mark.parametrize("batch", range(1, 40))
@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_slices_tile_the_global_batch_in_rank_order(batch, size):
    if batch < size:
        with pytest.raises(ShardingError):
            micro_batch_sizes(batch, size)
        sizes = micro_batch_sizes(batch, size, allow_empty=True)
    else:
        sizes = micro_batch_sizes(batch, size)
    assert sum(sizes) == batch
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True), "remainder must go to the first ranks"
    covered = np.concatenate([np.arange(batch)[micro_batch_slice(batch, r, size, allow_empty=True)]
                              for r in range(size)])
    assert covered.tolist() == list(range(batch))


def test_remainder_goes_to_first_ranks():
    assert micro_batch_sizes(10, 4) == [3, 3, 2, 2]
    assert [micro_batch_offset(10, r, 4) for r in range(4)] == [0, 3, 6, 8]
    assert micro_batch_size(10, 3, 4) == 2
    assert micro_batch_sizes(3, 4, allow_empty=True) == [1, 1, 1, 0]


def test_too_small_batch_error_says_what_to_do():
    with pytest.raises(ShardingError) as err:
        micro_batch_sizes(3, 4)
    msg = str(err.value)
    assert "global batch size 3 is smaller than the number of ranks 4" in msg
    assert "use a global batch size >= 4" in msg


@pytest.mark.parametrize("args, words", [
    ((2.5, 2), "global batch size must be an integer"),
    ((8, 0), "number of ranks must be >= 1"),
    ((-1, 2), "must be >= 0"),
])
def test_invalid_inputs(args, words):
    with pytest.raises(ShardingError, match=words):
        micro_batch_sizes(*args)


def test_rank_out_of_range():
    with pytest.raises(ShardingError, match=r"rank 4 is not in \[0, 4\)"):
        micro_batch_slice(8, 4, 4)


def test_numpy_integers_are_accepted():
    assert micro_batch_sizes(np.int64(9), np.int32(2)) == [5, 4]


def test_shard_context():
    ctx = ShardContext(rank=1, size=3, global_batch_size=10)
    assert ctx.sizes == [4, 3, 3]
    assert ctx.slice_of(10) == slice(4, 7)
    assert ctx.slice_of(2) == slice(1, 2)  # short last batch: rank 2 gets nothing
    assert ShardContext(rank=2, size=3).slice_of(2) == slice(2, 2)
    with pytest.raises(ShardingError, match="micro batch size 4 x 3 ranks != global batch size 10"):
        ShardContext(rank=0, size=3, global_batch_size=10, micro_batch_size=4)
    with pytest.raises(ShardingError):
        ShardContext(rank=3, size=3)
