"""Deterministic random streams derived from (seed, key, ...).

Every random decision (partitioning, client sampling, shuffling, initialisation, dropout) draws from a
stream named by the run seed and a tuple of keys such as ``("sample", round)`` or
``("shuffle", round, client)``. A stream depends only on its name, so skipping, reordering or resuming
work never shifts the randomness of anything else.

Model initialisation, dropout and some augmentations can only draw from torch's process-wide generator, which
is seeded from such a stream just before. Two runs side by side in threads of one process would re-seed it
under each other (and set each other's thread count), so whatever uses it holds :data:`PROCESS_STREAM`: runs
in one process take turns; runs in parallel use processes (``fedsight run --jobs``).
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import torch


#: held (``with PROCESS_STREAM:``) while a thread uses torch's process-wide generator and thread count: another
#: thread entering waits until this one leaves; re-entrant, so a run may hold it around parts that hold it too
PROCESS_STREAM = threading.RLock()


#: the largest seed a config may give (``seed``, ``validation.seed``, ``sweep.seeds``): seeds are 64-bit signed
#: integers, TOML's integer range (a run's ``config.toml`` must hold its seed) and within numpy's and torch's
#: generators (``derive_seed`` hashes the seed, ``torch.manual_seed`` takes at most 2**64 - 1)
SEED_MAX = 2**63 - 1


def check_seed(value: int, key: str | None = None) -> int:
    """``value`` if it is a seed in ``0..SEED_MAX``; else a ValueError saying the range and why (prefixed with
    ``key = value: `` when ``key`` is given; a config field's message gets its key from the validator)."""
    if not 0 <= value <= SEED_MAX:
        where = f"{key} = {value}: " if key else ""
        raise ValueError(f"{where}out of range: seeds are 64-bit signed integers, 0 to {SEED_MAX} (2**63 - 1)")
    return value


def _key_text(key: object) -> str:
    if isinstance(key, (bool, np.bool_)):
        raise TypeError("stream keys are ints or strings, not bools")
    if isinstance(key, (int, np.integer)):
        return f"i{int(key)}"
    if isinstance(key, str):
        return f"s{key}"
    raise TypeError(f"stream keys are ints or strings, got {type(key).__name__}")


def derive_seed(seed: int, *keys: object) -> int:
    """A 63-bit seed that depends only on ``seed`` and ``keys`` (BLAKE2b of their canonical text)."""
    text = "\x1f".join([_key_text(int(seed)), *map(_key_text, keys)])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def np_rng(seed: int, *keys: object) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, *keys))


def seed_torch(seed: int, *keys: object) -> None:
    """Seed torch's global CPU generator (dropout, random augmentation) from a named stream.

    ``torch.manual_seed`` would also seed the lazy CUDA/XPU/MTIA generators, which costs a stack
    capture per call; the simulator only needs the CPU generator."""
    torch.default_generator.manual_seed(derive_seed(seed, *keys))


def torch_gen(seed: int, *keys: object) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(derive_seed(seed, *keys))
    return g
