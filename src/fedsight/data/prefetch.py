"""Ordered, bounded read-ahead over a persistent worker pool, and the byte-bounded LRU cache of decoded images.

:class:`Prefetcher` computes ``fn(item)`` for a stream of items up to ``depth`` items ahead of the consumer, on
a pool of threads or processes that is created once and reused by every later :meth:`Prefetcher.map` call (a
simulator calls ``map`` once per client per round). Results come back in input order; an exception raised by
``fn`` is re-raised at the item where it happened. Abandoning an iterator (``break``) cancels the work queued
for it; at most the ``workers`` items already running finish, so nothing runs on forever.

Threads suit PIL decoding (it releases the GIL while inflating and resizing) and torch compute in the consumer
(it releases the GIL too). Processes use the ``"spawn"`` (or ``"forkserver"``) start method, never ``"fork"``,
which can deadlock a process that has already started torch's thread pools; ``fn`` must then be picklable (a
module-level function or a ``functools.partial`` of one) and results travel back pickled. Worker processes
end with the process that started them, even when it is SIGKILLed (``fedsight.lifeline``): the pool starts
all of them at once, from the thread that first maps.

:class:`LRUCache` is the thread-safe cache of decoded images behind ``FileImageStore(cache_bytes=...)``:
least recently used entries are evicted once the total ``nbytes`` would exceed the bound.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import functools
import hashlib
import multiprocessing
import os
import pickle
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

__all__ = ["CacheInfo", "LRUCache", "Prefetcher", "pin_tensors", "shared_cache"]


# ------------------------------------------------------------------------------------------ helpers


def pin_tensors(obj: Any) -> Any:
    """``obj`` with every CPU tensor in it (through tuples, namedtuples, lists and dicts) pinned."""
    if isinstance(obj, torch.Tensor):
        return obj.pin_memory() if obj.device.type == "cpu" and not obj.is_pinned() else obj
    if isinstance(obj, tuple):
        items = [pin_tensors(o) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return [pin_tensors(o) for o in obj]
    if isinstance(obj, dict):
        return type(obj)((k, pin_tensors(v)) for k, v in obj.items())
    return obj


def _star(fn: Callable[..., Any], args: Iterable[Any]) -> Any:
    return fn(*args)


def _call_pinned(fn: Callable[[Any], Any], item: Any) -> Any:
    return pin_tensors(fn(item))


# process workers keep the last few unpickled functions (by content hash of their pickle), so a store shipped
# with every item is unpickled once per worker and its decode cache survives from one item (and round) to the next
_WORKER_FNS: collections.OrderedDict[bytes, Callable[[Any], Any]] = collections.OrderedDict()
_WORKER_FNS_MAX = 8


def _worker_init(threads: int, parent: int | None = None, deathsig: bool = False) -> None:
    from ..lifeline import die_with_parent

    die_with_parent(parent, deathsig)  # a SIGKILLed consumer leaves no orphaned worker
    torch.set_num_threads(threads)


def _worker_call(token: bytes, payload: bytes, item: Any) -> bytes:
    fn = _WORKER_FNS.get(token)
    if fn is None:
        fn = pickle.loads(payload)
        _WORKER_FNS[token] = fn
        while len(_WORKER_FNS) > _WORKER_FNS_MAX:
            _WORKER_FNS.popitem(last=False)
    else:
        _WORKER_FNS.move_to_end(token)
    return pickle.dumps(fn(item), protocol=pickle.HIGHEST_PROTOCOL)


def _shutdown(pool: cf.Executor, wait: bool) -> None:
    pool.shutdown(wait=wait, cancel_futures=True)


class _Closed(RuntimeError):
    pass


# ------------------------------------------------------------------------------------------------ cache


CacheInfo = NamedTuple(
    "CacheInfo", [("hits", int), ("misses", int), ("entries", int), ("nbytes", int), ("max_bytes", int)]
)


class LRUCache:
    """Thread-safe LRU of read-only arrays bounded by their total ``nbytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self.nbytes = self.hits = self.misses = 0
        self._data: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> np.ndarray | None:
        with self._lock:
            arr = self._data.get(key)
            if arr is None:
                self.misses += 1
            else:
                self.hits += 1
                self._data.move_to_end(key)
            return arr

    def put(self, key: bytes, arr: np.ndarray) -> None:
        if arr.nbytes > self.max_bytes:
            return  # would evict everything and still not fit
        arr.flags.writeable = False
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                return
            self._data[key] = arr
            self.nbytes += arr.nbytes
            while self.nbytes > self.max_bytes:
                _, old = self._data.popitem(last=False)
                self.nbytes -= old.nbytes

    def info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self.hits, self.misses, len(self._data), self.nbytes, self.max_bytes)


# one cache per store identity and process, shared by a store's compact copies (pickled views of it); the
# registry holds caches weakly, so a cache lives as long as some store uses it
_CACHES: weakref.WeakValueDictionary[str, LRUCache] = weakref.WeakValueDictionary()
_CACHES_LOCK = threading.Lock()


def shared_cache(uid: str, max_bytes: int) -> LRUCache:
    with _CACHES_LOCK:
        cache = _CACHES.get(uid)
        if cache is None:
            cache = _CACHES[uid] = LRUCache(max_bytes)
        return cache


# -------------------------------------------------------------------------------------------- iterators


class _Ahead(Iterator[Any]):
    """Keeps ``depth`` futures queued behind the one the consumer waits for; yields results in order."""

    def __init__(
        self,
        submit: Callable[[Any], cf.Future[Any]],
        items: Iterable[Any],
        depth: int,
        finish: Callable[[Any], Any],
        on_broken: Callable[[], None],
    ) -> None:
        self._submit, self._finish, self._on_broken = submit, finish, on_broken
        self._items: Iterator[Any] | None = iter(items)
        self._pending: collections.deque[cf.Future[Any]] = collections.deque()
        self._error: BaseException | None = None
        self._late: Exception | None = None
        for _ in range(depth):
            if not self._push():
                break

    def _push(self) -> bool:
        if self._items is None:
            return False
        try:
            item = next(self._items)
            self._pending.append(self._submit(item))
        except StopIteration:
            self._items = None
            return False
        except Exception as e:  # the items iterable (or submit) failed: raise it after the items before it
            self._items, self._late = None, e
            return False
        return True

    def __next__(self) -> Any:
        if self._error is not None:
            raise self._error
        if not self._pending:
            late, self._late = self._late, None
            self.close()
            if late is not None:
                raise late
            raise StopIteration
        fut = self._pending.popleft()
        try:
            self._push()  # keep the workers busy while the consumer waits for this item
            result = fut.result()
        except cf.BrokenExecutor:
            self._on_broken()
            self.close()
            raise
        except BaseException:
            self.close()
            raise
        return self._finish(result)

    def close(self, error: BaseException | None = None) -> None:
        """Cancel the queued work (items already running finish); later ``next`` raises ``error`` or stops."""
        pending, self._pending = self._pending, collections.deque()
        for fut in pending:
            fut.cancel()
        self._items = None
        if error is not None:
            self._error = error

    def __enter__(self) -> _Ahead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class _Inline(Iterator[Any]):
    def __init__(self, fn: Callable[[Any], Any], items: Iterable[Any], pin: bool) -> None:
        self._fn, self._items, self._pin = fn, iter(items), pin

    def __next__(self) -> Any:
        out = self._fn(next(self._items))
        return pin_tensors(out) if self._pin else out

    def close(self) -> None:
        self._items = iter(())

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -------------------------------------------------------------------------------------------- prefetcher


class Prefetcher:
    """``map(fn, items)`` yields ``fn(item)`` in order, computed up to ``depth`` items ahead on ``workers`` workers.

    At most ``depth + 1`` items are in flight (the one the consumer waits for and ``depth`` queued behind it), so
    ``depth >= workers`` keeps every worker busy. ``workers=0`` computes inline in the consumer's thread. The pool is created on the first ``map`` and reused
    until :meth:`close` (or context-manager exit); a later ``map`` after ``close`` starts a new one.
    ``pin_memory=True`` pins the tensors in each result when CUDA is available and is a no-op otherwise.
    ``mp_context`` (``"spawn"`` or ``"forkserver"``) and ``worker_threads`` (torch intra-op threads per worker
    process) apply to the process backend only.
    """

    def __init__(
        self,
        workers: int = 0,
        depth: int = 2,
        backend: Literal["thread", "process"] = "thread",
        pin_memory: bool = False,
        *,
        mp_context: Literal["spawn", "forkserver"] = "spawn",
        worker_threads: int = 1,
    ) -> None:
        if int(workers) < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        if int(depth) < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if backend not in ("thread", "process"):
            raise ValueError(f"backend must be 'thread' or 'process', got {backend!r}")
        if mp_context not in ("spawn", "forkserver"):
            raise ValueError(f"mp_context must be 'spawn' or 'forkserver' ('fork' can deadlock torch): {mp_context!r}")
        self.workers, self.depth, self.backend = int(workers), int(depth), backend
        self.mp_context, self.worker_threads = mp_context, int(worker_threads)
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        self._pool: cf.Executor | None = None
        self._finalizer: weakref.finalize | None = None
        self._lock = threading.Lock()
        self._live: weakref.WeakSet[_Ahead] = weakref.WeakSet()

    def __repr__(self) -> str:
        return f"Prefetcher(workers={self.workers}, depth={self.depth}, backend={self.backend!r})"

    def _get_pool(self) -> cf.Executor:
        with self._lock:
            if self._pool is None:
                if self.backend == "thread":
                    pool: cf.Executor = cf.ThreadPoolExecutor(self.workers, thread_name_prefix="fedsight-prefetch")
                else:
                    # workers die with this process (fedsight.lifeline); they are all started here, now,
                    # so that the parent-death signal is tied to this thread, and only if it is the main one
                    eager = hasattr(cf.ProcessPoolExecutor, "_launch_processes")
                    main = threading.current_thread() is threading.main_thread()
                    spawn = self.mp_context == "spawn"
                    parent = os.getpid() if spawn else None  # forkserver: the (single-threaded) server forks
                    deathsig = not spawn or (main and eager)
                    pool = cf.ProcessPoolExecutor(
                        self.workers,
                        mp_context=multiprocessing.get_context(self.mp_context),
                        initializer=_worker_init,
                        initargs=(self.worker_threads, parent, deathsig),
                    )
                    if eager:  # CPython >= 3.9 would start them on demand, from whichever thread submits
                        pool._launch_processes()  # type: ignore[attr-defined]
                self._pool = pool
                # shuts the pool down (without waiting) if the prefetcher is garbage-collected or at exit
                self._finalizer = weakref.finalize(self, _shutdown, pool, False)
            return self._pool

    def _drop_pool(self, pool: cf.Executor) -> None:
        """Forget a broken process pool so that the next ``map`` starts a new one."""
        with self._lock:
            if self._pool is pool:
                self._pool = None
                if self._finalizer is not None:
                    self._finalizer()
                    self._finalizer = None

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        """Iterator over ``fn(item)`` for each item, in order. Work on the first items starts right away.

        The returned iterator has ``close()`` (cancel the queued work) and is a context manager; dropping it
        cancels the queued work as well.
        """
        if self.workers == 0:
            return _Inline(fn, items, self.pin_memory)
        pool = self._get_pool()
        if self.backend == "thread":
            call = functools.partial(_call_pinned, fn) if self.pin_memory else fn

            def submit(item: Any) -> cf.Future[Any]:
                return pool.submit(call, item)

            finish: Callable[[Any], Any] = _identity
        else:
            payload = pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL)
            token = hashlib.blake2b(payload, digest_size=16).digest()

            def submit(item: Any) -> cf.Future[Any]:
                return pool.submit(_worker_call, token, payload, item)

            finish = _unpickle_pinned if self.pin_memory else pickle.loads
        it = _Ahead(submit, items, self.depth, finish, functools.partial(self._drop_pool, pool))
        self._live.add(it)
        return it

    def starmap(self, fn: Callable[..., Any], items: Iterable[Iterable[Any]]) -> Iterator[Any]:
        """Like :meth:`map` with ``fn(*args)`` for each tuple ``args``, e.g. ``(indices, key)`` for ``load_batch``."""
        return self.map(functools.partial(_star, fn), items)

    def close(self) -> None:
        """Cancel all queued work, wait for running items and shut the pool down. Idempotent."""
        for it in list(self._live):
            it.close(_Closed("the Prefetcher was closed while this iterator was in use"))
        with self._lock:
            pool, self._pool = self._pool, None
            if self._finalizer is not None:
                self._finalizer.detach()
                self._finalizer = None
        if pool is not None:
            _shutdown(pool, True)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _identity(x: Any) -> Any:
    return x


def _unpickle_pinned(data: bytes) -> Any:
    return pin_tensors(pickle.loads(data))
