from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxserve.core.page_pool import PagePool, FreePageQueue, KVCachePage


def ids(pages):
    return [b.page_id for b in pages]


def test_free_queue_order_and_o1_ops():
    pages = [KVCachePage(i) for i in range(5)]
    q = FreePageQueue(pages)
    assert q.num_free == 5 and len(q) == 5
    assert q.popleft() is pages[0]
    q.remove(pages[2])  # middle
    assert ids(q.get_all_free_pages()) == [1, 3, 4]
    q.append(pages[0])
    q.append(pages[2])
    assert ids(q.get_all_free_pages()) == [1, 3, 4, 0, 2]
    q.remove(pages[2])  # tail
    q.remove(pages[1])  # head
    assert ids(q.get_all_free_pages()) == [3, 4, 0]
    assert q.num_free == 3
    assert pages[1].prev_free is None and pages[1].next_free is None


def test_free_queue_rejects_misuse():
    q = FreePageQueue()
    b = KVCachePage(7)
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
    pool = PagePool(5)
    assert pool.get_num_free_pages() == 4
    got = pool.get_new_pages(4)
    assert ids(got) == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.null_page.page_id == 0 and pool.null_page not in got
    with pytest.raises(ValueError):
        pool.get_new_pages(1)
    assert pool.get_usage() == 1.0
    pool.free_pages(got + [pool.null_page])  # freeing the null page is a no-op
    assert pool.get_num_free_pages() == 4
    assert ids(pool.free_queue.get_all_free_pages()) == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        PagePool(1)


def test_free_appends_in_given_order_and_usage():
    pool = PagePool(6)
    a = pool.get_new_pages(3)  # 1,2,3
    assert pool.get_usage() == pytest.approx(3 / 5)
    pool.free_pages(reversed(a))
    assert ids(pool.free_queue.get_all_free_pages()) == [4, 5, 3, 2, 1]
    assert pool.get_usage() == 0.0
    assert ids(pool.get_new_pages(3)) == [4, 5, 3]


def test_ref_counts_touch_and_double_free():
    pool = PagePool(4)
    [b1, b2] = pool.get_new_pages(2)
    pool.touch([b1])
    assert b1.ref_cnt == 2
    pool.free_pages([b1])
    assert b1.ref_cnt == 1 and pool.get_num_free_pages() == 1
    pool.free_pages([b1, b2])
    assert b1.ref_cnt == 0 and pool.get_num_free_pages() == 3
    with pytest.raises(ValueError):
        pool.free_pages([b1])
    # touching a free page takes it out of the free queue
    pool.touch([b2])
    assert b2.ref_cnt == 1
    assert ids(pool.free_queue.get_all_free_pages()) == [3, 1]


def test_cache_lookup_touch_and_eviction():
    pool = PagePool(4)
    req = SimpleNamespace(page_hashes=[111, 222])
    pages = pool.get_new_pages(3)  # 1,2,3; third page not full
    pool.cache_full_pages(req, pages, 0, 2)
    assert pool.get_cached_page(111) is pages[0]
    assert pool.get_cached_page(222) is pages[1]
    assert pages[2].page_hash is None
    pool.free_pages(reversed(pages))  # queue: 3, 2, 1 (all free, 1 and 2 cached)
    assert pool.get_cached_page(222) is pages[1]  # still cached while free
    pool.touch([pages[0]])  # prefix hit on a free-but-cached page
    assert ids(pool.free_queue.get_all_free_pages()) == [3, 2]
    got = pool.get_new_pages(2)  # 3 then 2: page 2 loses its hash
    assert ids(got) == [3, 2]
    assert pool.get_cached_page(222) is None and got[1].page_hash is None
    assert pool.get_cached_page(111) is pages[0]


def test_duplicate_hash_keeps_first_page():
    pool = PagePool(4)
    a, b = pool.get_new_pages(2)
    pool.cache_full_pages(SimpleNamespace(page_hashes=[5]), [a], 0, 1)
    pool.cache_full_pages(SimpleNamespace(page_hashes=[5]), [b], 0, 1)
    assert pool.get_cached_page(5) is a and b.page_hash is None
    # evicting the unregistered duplicate must not drop the real entry
    pool.free_pages([b])
    pool.get_new_pages(2)
    assert pool.get_cached_page(5) is a


def test_caching_disabled_and_reset():
    off = PagePool(3, enable_caching=False)
    pages = off.get_new_pages(1)
    off.cache_full_pages(SimpleNamespace(page_hashes=[9]), pages, 0, 1)
    assert off.get_cached_page(9) is None and pages[0].page_hash is None

    on = PagePool(3)
    pages = on.get_new_pages(1)
    on.cache_full_pages(SimpleNamespace(page_hashes=[9]), pages, 0, 1)
    assert on.get_cached_page(9) is pages[0]
    on.reset_prefix_cache()
    assert on.get_cached_page(9) is None and pages[0].page_hash is None
