"""KV block pool at scale: build time and per-operation cost from 10^4 to 10^7 blocks.

For each pool size and eviction policy it measures, through :class:`KVCacheManager`:

* ``build_ms``: constructing the manager (best of 3);
* ``alloc+free``: allocate a request's 8 blocks (128 tokens) and free it, blocks uncached;
* ``hit``: a request whose first 8 blocks are cached: ``lookup_prefix`` + ``allocate`` with
  those blocks (the policy's ``on_hit``) + ``free`` (its ``on_free``);
* ``evict``: with every block of the pool cached and free, allocate 8 blocks (8 evictions),
  index them as computed, and free them back into the cache.

Each is reported in microseconds per request (8 blocks), best of ``--repeats`` rounds of
``--ops`` requests. The pool is filled with cached free blocks through pool-level calls
(allocate, ``mark_cached``, release in chunks of 2^20): going through the manager would
spend minutes hashing tokens for 10^7 blocks, and the prefix index has no say in the cost
of eviction. The old pool (one Python object per block, ``min()`` scan in FIFO) is gone; the
point here is that every column stays flat as the pool grows 1000-fold.

Run: ``python -m benchmarks.kv_pool [--sizes 1e4 1e5 1e6 1e7]``.
"""

from __future__ import annotations

import argparse
import itertools
import time

import attrs

from llmlab.cache import EVICTION_POLICIES, BlockPool, KVCacheManager

BLOCK_SIZE = 16
BLOCKS_PER_REQUEST = 8
FILL_CHUNK_BLOCKS = 1 << 20


@attrs.define(eq=False)
class BenchRequest:
    """The fields of ``llmlab.request.Request`` that the cache manager reads."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    block_hashes: list[int] = attrs.field(factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


_ids = itertools.count()
_first_token = itertools.count(0, 1_000)


def new_request(tokens: list[int] | None = None) -> BenchRequest:
    """A request with fresh tokens (no prefix shared with any other) unless given."""
    if tokens is None:
        start = next(_first_token)
        tokens = list(range(start, start + BLOCKS_PER_REQUEST * BLOCK_SIZE))
    return BenchRequest(f"b{next(_ids)}", tokens)


def fill_with_cached_free_blocks(pool: BlockPool) -> None:
    """Make every empty block cached and free, released in block id order."""
    chunks = []
    while pool.num_empty_blocks:
        block_ids, _ = pool.allocate(min(FILL_CHUNK_BLOCKS, pool.num_empty_blocks))
        pool.mark_cached(block_ids)
        chunks.append(block_ids)
    for block_ids in chunks:
        pool.release(block_ids)


def best_us_per_op(run_round, num_ops: int, repeats: int) -> float:
    """Best of ``repeats`` rounds; ``run_round(num_ops)`` returns its own timed seconds."""
    return min(run_round(num_ops) for _ in range(repeats)) / num_ops * 1e6


def alloc_free_round(kv: KVCacheManager):
    def run(num_ops: int) -> float:
        requests = [new_request() for _ in range(num_ops)]
        num_tokens = BLOCKS_PER_REQUEST * BLOCK_SIZE
        start = time.perf_counter()
        for r in requests:
            kv.allocate(r, num_tokens)
            kv.free(r)
        return time.perf_counter() - start

    return run


def hit_round(kv: KVCacheManager):
    # One request computes and caches 8 full blocks; every later one hits all 8.
    tokens = new_request().all_token_ids + [7]
    warm = new_request(tokens)
    kv.allocate(warm, len(tokens))
    warm.num_computed_tokens = len(tokens)
    kv.cache_computed_blocks(warm)
    kv.free(warm)

    def run(num_ops: int) -> float:
        requests = [new_request(tokens) for _ in range(num_ops)]
        start = time.perf_counter()
        for r in requests:
            prefix = kv.lookup_prefix(r)
            kv.allocate(r, 1, prefix)
            kv.free(r)
        return time.perf_counter() - start

    return run


def evict_round(kv: KVCacheManager):
    def run(num_ops: int) -> float:
        requests = [new_request() for _ in range(num_ops)]
        num_tokens = BLOCKS_PER_REQUEST * BLOCK_SIZE
        start = time.perf_counter()
        for r in requests:
            kv.allocate(r, num_tokens)  # the pool has no empty block: 8 evictions
            r.num_computed_tokens = num_tokens
            kv.cache_computed_blocks(r)
            kv.free(r)  # back into the cache as candidates
        return time.perf_counter() - start

    return run


def measure(num_blocks: int, policy_name: str, num_ops: int, repeats: int) -> dict[str, float]:
    policy_cls = EVICTION_POLICIES[policy_name]
    build_s = []
    for _ in range(3):
        start = time.perf_counter()
        kv = KVCacheManager(num_blocks, BLOCK_SIZE, eviction=policy_cls())
        build_s.append(time.perf_counter() - start)
    row = {"build_ms": min(build_s) * 1e3}
    row["alloc+free_us"] = best_us_per_op(alloc_free_round(kv), num_ops, repeats)
    start = time.perf_counter()
    fill_with_cached_free_blocks(kv.pool)
    row["fill_s"] = time.perf_counter() - start
    assert kv.pool.num_cached_free_blocks == num_blocks
    row["hit_us"] = best_us_per_op(hit_round(kv), num_ops, repeats)
    row["evict_us"] = best_us_per_op(evict_round(kv), num_ops, repeats)
    assert kv.pool.num_cached_free_blocks == num_blocks
    kv.pool.check()
    return row


COLUMNS = ["build_ms", "fill_s", "alloc+free_us", "hit_us", "evict_us"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e4, 1e5, 1e6, 1e7])
    parser.add_argument("--policies", nargs="+", default=list(EVICTION_POLICIES))
    parser.add_argument("--ops", type=int, default=300, help="requests per timed round")
    parser.add_argument("--repeats", type=int, default=7, help="rounds; the best one counts")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes]

    print(
        f"block_size={BLOCK_SIZE}; per-op columns in us per request of {BLOCKS_PER_REQUEST} blocks"
    )
    print(f"{'num_blocks':>10} {'policy':>7} " + " ".join(f"{c:>13}" for c in COLUMNS))
    results: dict[tuple[int, str], dict[str, float]] = {}
    total_start = time.perf_counter()
    for num_blocks in sizes:
        for policy_name in args.policies:
            row = measure(num_blocks, policy_name, args.ops, args.repeats)
            results[num_blocks, policy_name] = row
            cells = " ".join(f"{row[c]:>13.3f}" for c in COLUMNS)
            print(f"{num_blocks:>10} {policy_name:>7} {cells}", flush=True)
    if len(sizes) > 1:
        print(f"\nper-op cost at {sizes[-1]:,} blocks relative to {sizes[0]:,} (1.00 = flat):")
        for policy_name in args.policies:
            small, large = results[sizes[0], policy_name], results[sizes[-1], policy_name]
            ratios = "  ".join(
                f"{c}={large[c] / small[c]:.2f}" for c in ("alloc+free_us", "hit_us", "evict_us")
            )
            print(f"  {policy_name:>7}: {ratios}")
    print(f"\ntotal {time.perf_counter() - total_start:.1f} s")


if __name__ == "__main__":
    main()
