from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxserve.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_order_and_o1_ops():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.num_free == 5 and len(q) == 5
    assert q.popleft() is blocks[0]
    q.remove(blocks[2])  # middle
    assert ids(q.get_all_free_blocks()) == [1, 3, 4]
    q.append(blocks[0])
    q.append(blocks[2])
    assert ids(q.get_all_free_blocks()) == [1, 3, 4, 0, 2]
    q.remove(blocks[2])  # tail
    q.remove(blocks[1])  # head
    assert ids(q.get_all_free_blocks()) == [3, 4, 0]
    assert q.num_free == 3
    assert blocks[1].prev_free is None and blocks[1].next_free is None


def test_free_queue_rejects_misuse():
    q = FreeBlockQueue()
    b = KVCacheBlock(7)
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(ValueError):
        q.remove(b)
    q.append(b)
    with pytest.raises(ValueError):
        q.append(b)
    assert q.popleft() is b
    assert q.num_free == 0


def test_null_page_never_handed_out():
    pool = BlockPool(5)
    assert pool.get_num_free_blocks() == 4
    got = pool.get_new_blocks(4)
    assert ids(got) == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.null_block.block_id == 0 and pool.null_block not in got
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    assert pool.get_usage() == 1.0
    pool.free_blocks(got + [pool.null_block])  # freeing the null page is a no-op
    assert pool.get_num_free_blocks() == 4
    assert ids(pool.free_queue.get_all_free_blocks()) == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        BlockPool(1)


def test_free_appends_in_given_order_and_usage():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # 1,2,3
    assert pool.get_usage() == pytest.approx(3 / 5)
    pool.free_blocks(reversed(a))
    assert ids(pool.free_queue.get_all_free_blocks()) == [4, 5, 3, 2, 1]
    assert pool.get_usage() == 0.0
    assert ids(pool.get_new_blocks(3)) == [4, 5, 3]


def test_ref_counts_touch_and_double_free():
    pool = BlockPool(4)
    [b1, b2] = pool.get_new_blocks(2)
    pool.touch([b1])
    assert b1.ref_cnt == 2
    pool.free_blocks([b1])
    assert b1.ref_cnt == 1 and pool.get_num_free_blocks() == 1
    pool.free_blocks([b1, b2])
    assert b1.ref_cnt == 0 and pool.get_num_free_blocks() == 3
    with pytest.raises(ValueError):
        pool.free_blocks([b1])
    # touching a free page takes it out of the free queue
    pool.touch([b2])
    assert b2.ref_cnt == 1
    assert ids(pool.free_queue.get_all_free_blocks()) == [3, 1]


def test_cache_lookup_touch_and_eviction():
    pool = BlockPool(4)
    req = SimpleNamespace(block_hashes=[111, 222])
    blocks = pool.get_new_blocks(3)  # 1,2,3; third page not full
    pool.cache_full_blocks(req, blocks, 0, 2)
    assert pool.get_cached_block(111) is blocks[0]
    assert pool.get_cached_block(222) is blocks[1]
    assert blocks[2].block_hash is None
    pool.free_blocks(reversed(blocks))  # queue: 3, 2, 1 (all free, 1 and 2 cached)
    assert pool.get_cached_block(222) is blocks[1]  # still cached while free
    pool.touch([blocks[0]])  # prefix hit on a free-but-cached page
    assert ids(pool.free_queue.get_all_free_blocks()) == [3, 2]
    got = pool.get_new_blocks(2)  # 3 then 2: page 2 loses its hash
    assert ids(got) == [3, 2]
    assert pool.get_cached_block(222) is None and got[1].block_hash is None
    assert pool.get_cached_block(111) is blocks[0]


def test_duplicate_hash_keeps_first_page():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks(SimpleNamespace(block_hashes=[5]), [a], 0, 1)
    pool.cache_full_blocks(SimpleNamespace(block_hashes=[5]), [b], 0, 1)
    assert pool.get_cached_block(5) is a and b.block_hash is None
    # evicting the unregistered duplicate must not drop the real entry
    pool.free_blocks([b])
    pool.get_new_blocks(2)
    assert pool.get_cached_block(5) is a


def test_caching_disabled_and_reset():
    off = BlockPool(3, enable_caching=False)
    blocks = off.get_new_blocks(1)
    off.cache_full_blocks(SimpleNamespace(block_hashes=[9]), blocks, 0, 1)
    assert off.get_cached_block(9) is None and blocks[0].block_hash is None

    on = BlockPool(3)
    blocks = on.get_new_blocks(1)
    on.cache_full_blocks(SimpleNamespace(block_hashes=[9]), blocks, 0, 1)
    assert on.get_cached_block(9) is blocks[0]
    on.reset_prefix_cache()
    assert on.get_cached_block(9) is None and blocks[0].block_hash is None
