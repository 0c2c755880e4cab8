"""KVClient: AsyncKVClient for synchronous engines.

The client owns an asyncio event loop running in a daemon thread; every method submits the
async call to it (asyncio.run_coroutine_threadsafe) and waits. Any thread may call; calls from
several threads run concurrently on the loop. `submit_load` / `submit_store` /
`submit_prefetch` / `submit_lookup` return a concurrent.futures.Future instead of waiting, so a scheduler can
issue loads and keep scheduling other requests while they land.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import grpc

from engine_client.client import AsyncKVClient, PoolDescriber
from engine_client.errors import KVClientError
from engine_client.hashing import BlockHasher
from engine_client.namespace import Namespace
from engine_client.results import LoadResults, StoreResults

T = TypeVar("T")


class KVClient:
    """Same contract as AsyncKVClient (see client.py), with blocking methods. Context manager."""

    def __init__(
        self,
        target: str,
        namespace: Namespace,
        pool: PoolDescriber,
        client_name: str = "",
        heartbeat_interval: float | None = None,
        **options: float,
    ) -> None:
        """Arguments as AsyncKVClient; `options` are its keyword-only timeouts."""
        self._client = AsyncKVClient(target, namespace, pool, client_name, heartbeat_interval, **options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvclient-loop", daemon=True)
        self._thread.start()
        self._stopped = False

    # --- state (plain attribute reads of the async client: safe from any thread)
    @property
    def attached(self) -> bool:
        return self._client.attached

    @property
    def session_id(self) -> str:
        return self._client.session_id

    @property
    def session_label(self) -> str:
        return self._client.session_label

    @property
    def namespace_id(self) -> str:
        return self._client.namespace_id

    @property
    def reattachments(self) -> int:
        return self._client.reattachments

    @property
    def error(self) -> KVClientError | None:
        return self._client.error

    @property
    def hasher(self) -> BlockHasher:
        return self._client.hasher

    # --- blocking calls
    def connect(self, required: bool = True) -> None:
        self._run(self._client.connect(required))

    def lookup(self, hashes: Sequence[bytes]) -> tuple[int, list[int]]:
        return self._run(self._client.lookup(hashes))

    def store(self, hashes: Sequence[bytes], block_ids: Sequence[int], ttl_seconds: float = 0.0
              ) -> StoreResults:
        return self._run(self._client.store(hashes, block_ids, ttl_seconds))

    def load(self, hashes: Sequence[bytes], block_ids: Sequence[int]) -> LoadResults:
        return self._run(self._client.load(hashes, block_ids))

    def prefetch(self, hashes: Sequence[bytes]) -> list[int]:
        return self._run(self._client.prefetch(hashes))

    def retain(self, hashes: Sequence[bytes], ttl_seconds: float) -> list[float]:
        return self._run(self._client.retain(hashes, ttl_seconds))

    # --- non-blocking calls
    def submit_store(self, hashes: Sequence[bytes], block_ids: Sequence[int], ttl_seconds: float = 0.0
                     ) -> concurrent.futures.Future[StoreResults]:
        return self._submit(self._client.store(hashes, block_ids, ttl_seconds))

    def submit_load(self, hashes: Sequence[bytes], block_ids: Sequence[int]
                    ) -> concurrent.futures.Future[LoadResults]:
        return self._submit(self._client.load(hashes, block_ids))

    def submit_prefetch(self, hashes: Sequence[bytes]) -> concurrent.futures.Future[list[int]]:
        return self._submit(self._client.prefetch(hashes))

    def submit_lookup(self, hashes: Sequence[bytes]) -> concurrent.futures.Future[tuple[int, list[int]]]:
        return self._submit(self._client.lookup(hashes))

    # --- lifetime
    def close(self) -> None:
        """Close the session and stop the loop thread. Idempotent."""
        if self._stopped:
            return
        try:
            self._run(self._client.close())
        finally:
            self._stopped = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> KVClient:
        if not self._client.connected:
            self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._stopped:
            coro.close()
            raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "KVClient is closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("KVClient methods must not be called from its own event-loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._submit(coro).result()
