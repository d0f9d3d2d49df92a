"""Fixed-size KV pages with reference counts, an O(1) LRU free queue and a
hash -> page map for automatic prefix caching."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from jaxserve.core.request import Request


class KVCacheBlock:
    """One KV page. `prev_free`/`next_free` link it into the FreeBlockQueue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks; front = least recently freed.

    Intrusive links (stored on the blocks) give O(1) removal from the middle,
    which a prefix hit on a free-but-cached page needs.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        # Sentinels remove the empty-list special cases.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is self._tail:
            raise ValueError("no free blocks left in the free queue")
        self.remove(first)
        return first

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __len__(self) -> int:
        return self.num_free

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Front to back; O(n), for tests and debugging."""
        out = []
        b = self._head.next_free
        while b is not self._tail:
            out.append(b)
            b = b.next_free
        return out


class BlockPool:
    """All KV pages. Block 0 is the null page: padding writes go there, it is
    never handed out and never freed."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[int, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def get_usage(self) -> float:
        """Fraction of non-null pages held by some request (ref_cnt > 0)."""
        total = self.num_blocks - 1
        return 1.0 - self.free_queue.num_free / total

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` pages from the front of the free queue (LRU first),
        evicting whatever prefix they cached."""
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot get {n} blocks, only {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            if b.block_hash is not None:
                self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
        block.block_hash = None

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        if not self.enable_caching:
            return None
        return self.cached_blocks.get(block_hash)

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register hashes for blocks[num_cached_blocks:num_full_blocks], which
        now hold full pages of request.all_token_ids."""
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        hashes = request.block_hashes
        if num_full_blocks > len(hashes) or num_full_blocks > len(blocks):
            raise ValueError(
                f"num_full_blocks={num_full_blocks} exceeds the request's "
                f"{len(hashes)} full-page hashes or {len(blocks)} blocks"
            )
        cached = self.cached_blocks
        null = self.null_block
        for i in range(num_cached_blocks, num_full_blocks):
            b = blocks[i]
            # A prefix hit (already registered), or a sliding-window group's null page
            # standing in for a page before the window.
            if b.block_hash is not None or b is null:
                continue
            h = hashes[i]
            # One page per hash: an independently computed duplicate stays
            # unregistered (it is simply not shareable).
            if h not in cached:
                b.block_hash = h
                cached[h] = b

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached pages (a prefix hit); free ones leave the
        free queue so they cannot be evicted. The null page is skipped (it is never
        counted, as free_blocks never frees it)."""
        fq = self.free_queue
        for b in blocks:
            if b is self.null_block:
                continue
            if b.ref_cnt == 0:
                fq.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; pages reaching 0 go to the tail of the free
        queue in the given order and keep their hash (evictable, LRU)."""
        fq = self.free_queue
        for b in ordered_blocks:
            if b is self.null_block:
                continue
            if b.ref_cnt <= 0:
                raise ValueError(f"double free of block {b.block_id}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                fq.append(b)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after a weight update). Pages in use
        keep their contents but can no longer be shared."""
        for b in self.cached_blocks.values():
            b.block_hash = None
        self.cached_blocks.clear()
