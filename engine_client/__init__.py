"""engine_client: what an inference engine links to use the kvservice daemon.

    ns = Namespace("llama-8b", "bfloat16", tokens_per_block=16, layout="block-contiguous")
    hasher = BlockHasher(ns)                       # chained block hashes, canary
    pool = ShmKVPool(num_blocks, block_bytes)       # engine KV pool the daemon can map (CPU hosts)
    pool = CudaKVPool(num_blocks, block_bytes)      # ... or on a GPU, registered by CUDA IPC
    with KVClient("unix:///run/kvservice/kvservice.sock", ns, pool) as kv:
        hashes = hasher.hash_blocks(token_ids)
        n, tiers = kv.lookup(hashes)
        results = kv.load(hashes[:n], block_ids[:n])

AsyncKVClient is the asyncio client; KVClient runs it on a private loop thread. Small blocks (64 KiB):
KVClient(..., blocks_per_key=k) has the daemon keep k pool blocks as one (hash in keys of k blocks, name
k block ids per hash); see AsyncKVClient.
"""

from engine_client.client import AsyncKVClient
from engine_client.errors import KVClientError
from engine_client.hashing import HASH_BYTES, BlockHasher
from engine_client.namespace import Namespace
from engine_client.results import LoadResult, LoadResults, PrefetchStatuses, StoreResult, StoreResults
from engine_client.shm_pool import ShmKVPool
from engine_client.sync_client import KVClient

__all__ = ["AsyncKVClient", "BlockHasher", "CudaKVPool", "HASH_BYTES", "KVClient", "KVClientError", "LoadResult",
           "LoadResults", "Namespace", "PrefetchStatuses", "ShmKVPool", "StoreResult", "StoreResults"]


def __getattr__(name: str):
    if name == "CudaKVPool":  # lazy: importing engine_client never loads CUDA libraries
        from engine_client.cuda_pool import CudaKVPool

        return CudaKVPool
    raise AttributeError(f"module 'engine_client' has no attribute {name!r}")
