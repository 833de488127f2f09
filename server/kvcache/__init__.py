"""KV-cache bookkeeping: who holds which KV page. Pure Python (no torch); the pages' tensors are
loop/kv_pool.py's and the kernels'.

    page_allocator.py   page ids in [0, num_pages): allocate, free
    slot_table.py       request slots: the bounded table of requests that hold pages
    prefix_cache.py     PrefixCache: RadixCache, the radix tree over token ids (ref counts, LRU
                        eviction, page hashes), and ChunkCache when it is off
    kv_events.py        what the prefix cache stored and dropped, for cache-aware routers: batched per
                        step for subscribers (bounded queues, replay from a cursor, snapshots); no
                        protobuf
"""
