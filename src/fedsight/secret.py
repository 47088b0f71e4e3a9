"""Secrets that protect a party: drawn from the operating system's CSPRNG by that party, kept only with it.

The project's rule: secrets (DP noise, keys) come from the OS's CSPRNG and stay with the party they protect;
they are never derived from a seed another party knows. What needs one:

* local DP noise (``dp_sgd``'s per-step noise and Poisson batches, ``dct_dp``'s activation noise): the client's
  secret, because the server is the party local DP protects against;
* central DP noise (``fedsight.flower.dp``, in-process through ``fedsight.central_dp``): the server's secret, because
  every participant is;
* the watermark key (``watermark``): the clients' key, unknown to the server.

``[privacy] noise`` switches a run (``NOISE_MODES``):

* ``"simulated"`` (the in-process default, for reproducible research): every stream is derived from the run
  seed, as ``fedsight.rng`` derives every other stream. Anyone holding ``config.json`` can regenerate the noise
  and the key; the run says so in ``run.json`` (each session's ``privacy_noise``, ``SIMULATED_NOTE``) and in
  ``summary.md``.
* ``"secret"``: each party draws 32 bytes once from ``secrets.token_bytes`` (the OS CSPRNG) and keeps them
  with itself; the party's noise generator for (purpose, round, client) is seeded from a keyed hash of the
  secret and those names (``secret_torch_gen``), so the streams stay independent and a resumed run draws exactly
  the noise the uninterrupted run would (the secret is read back from where it is kept). A Flower run is always
  ``"secret"`` (nodes and the ServerApp), whatever the config says.

Where secrets live (never in ``config.json``, a message, a log, ``metrics.jsonl``, ``run.json`` or a report):

* in-process: ``RUN_DIR/client_state/secret/<name>.key`` (32 bytes, mode 0600; ``ClientStateStore.secret``):
  the simulated clients' private store, ``client-0000003.key`` for client 3 and ``watermark.key`` for the
  clients' shared watermark key when no ``key_file`` is given. Without a run directory, in memory.
* a Flower node: ``<state-dir>/run-<id>/client-<k>/secret/client-<k>.key``, the node's own state folder.
* the Flower ServerApp, and the in-process server with ``[privacy.central_dp]``: ``RUN_DIR/private/central_dp.key``,
  the server's private run files (in-process, read back on resume: ``central_dp.keep_server_secret``).

A secret file is created once (the first time its party needs it) and never rewritten: a second draw finds
the first (``os.link`` refuses to replace it), so a run killed after a client drew its secret resumes with the
same one. The checkpoint names the secrets drawn (``ClientStateStore.state_dict``, never their bytes): on resume a
named secret that is missing, unreadable or not of 32 bytes is a ``RunFileError`` naming the file, raised before
anything changes (``check_secret``).

Generators: a CPU generator's whole Mersenne-Twister state (624 32-bit words) is filled from SHAKE-256 of
the secret and the stream's names, so its stream has the secret's entropy (``torch.Generator.manual_seed``
would keep only the low 32 bits of a seed: 2**32 candidate streams, as every seed-derived stream has). A CUDA
generator (Philox) takes a 64-bit seed, derived the same way. Neither generator is a CSPRNG: its outputs are
not released (they are added to values and then aggregated), and whoever cannot read the secret cannot seed
it. See ``docs/flower.md`` (security) for the floating-point caveat of Gaussian sampling.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import os
import secrets as _secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import RunFileError

#: ``[privacy] noise`` values
NOISE_MODES = ("simulated", "secret")
#: the size of every secret (bytes)
SECRET_BYTES = 32
#: what ``run.json`` (each session's ``privacy_noise``) and ``summary.md`` say of a simulated run
SIMULATED_NOTE = "simulated: the noise is derivable from the seed"
#: what they say of a run with secret noise
SECRET_NOTE = "secret: each party's noise and keys come from its own OS-CSPRNG secret, kept only with it"
#: the folder (under a run directory) of the Flower ServerApp's secrets
SERVER_PRIVATE_DIR = "private"


def draw_secret() -> bytes:
    """32 fresh bytes from the operating system's CSPRNG."""
    return _secrets.token_bytes(SECRET_BYTES)


def note(noise: str) -> str:
    """The sentence ``run.json`` and ``summary.md`` carry for a run of noise mode ``noise``."""
    return SIMULATED_NOTE if noise == "simulated" else SECRET_NOTE


def check_secret(path: Path) -> bytes:
    """The secret at ``path``, which must be there (a run that drew it resumes): a ``RunFileError`` naming the file
    if it is missing, unreadable or not of ``SECRET_BYTES`` bytes."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise RunFileError(f"{path}: secret missing (the checkpoint says it was drawn; a new one would change the "
                           "run's noise)") from None
    except OSError as exc:
        raise RunFileError(f"{path}: cannot read the secret ({exc.strerror or exc})") from None
    if len(data) != SECRET_BYTES:
        raise RunFileError(f"{path}: a secret file holds {SECRET_BYTES} bytes, this one {len(data)} (damaged?)")
    return data


def keep_secret(path: Path, must_exist: bool = False) -> bytes:
    """The secret kept at ``path``: read back if it is there, else (unless ``must_exist``: ``check_secret``) drawn
    now and written (mode 0600) without ever replacing a file another writer created meanwhile."""
    if must_exist:
        return check_secret(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{_secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(draw_secret())
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # fails if the file appeared meanwhile: that one is the secret
            except FileExistsError:
                pass
        finally:
            tmp.unlink(missing_ok=True)
        data = path.read_bytes()
    except OSError as exc:
        raise RunFileError(f"{path}: cannot read the secret ({exc.strerror or exc})") from None
    if len(data) != SECRET_BYTES:
        raise RunFileError(f"{path}: a secret file holds {SECRET_BYTES} bytes, this one {len(data)} (damaged?)")
    return data


def read_key_file(path: str | os.PathLike[str], what: str = "key_file", min_bytes: int = 16) -> bytes:
    """The raw key in ``path`` (as ``fedsight etlc keygen -o FILE`` writes: 32 random bytes); a missing,
    unreadable or short file is a ``ConfigError`` naming it."""
    from .errors import ConfigError

    p = Path(path).expanduser()
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{what} = {str(path)!r}: no such file (write one with `fedsight etlc keygen -o FILE`)") \
            from None
    except OSError as exc:
        raise ConfigError(f"{what} = {str(path)!r}: cannot read it ({exc.strerror or exc})") from None
    if len(data) < min_bytes:
        raise ConfigError(f"{what} = {str(path)!r}: {len(data)} bytes; a key needs at least {min_bytes} random bytes "
                          "(`fedsight etlc keygen -o FILE`)")
    return data


def _names(*keys: object) -> bytes:
    from .rng import _key_text

    return "\x1f".join(map(_key_text, keys)).encode()


def secret_bytes(secret: bytes, n: int, *keys: object) -> bytes:
    """``n`` bytes of SHAKE-256 keyed by ``secret`` over the stream's names ``keys`` (a PRF: without the secret
    they cannot be computed; different names give independent bytes)."""
    h = hashlib.shake_256()
    h.update(b"fedsight-secret-stream\x00" + len(secret).to_bytes(2, "little") + secret)
    h.update(_names(*keys))
    return h.digest(n)


#: a CPU generator's state: (seed u64, left i32, seeded i32, next u64, 624 x u64 words, normal cache ...)
_MT_WORDS, _MT_OFFSET = 624, 24


def secret_torch_gen(secret: bytes, *keys: object, device: Any = None) -> torch.Generator:
    """A torch generator on ``device`` (default CPU) seeded from ``secret`` and the stream's names ``keys``."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    gen = torch.Generator(device=dev)
    if dev.type == "cpu":
        state = gen.get_state()
        if state.numel() >= _MT_OFFSET + 8 * _MT_WORDS:
            buf = bytearray(state.numpy().tobytes())
            words = np.frombuffer(secret_bytes(secret, 4 * _MT_WORDS, *keys), dtype="<u4").astype("<u8")
            buf[0:8] = secret_bytes(secret, 8, "seed", *keys)  # (reported by initial_seed only)
            buf[8:12] = (1).to_bytes(4, "little")  # left = 1: the state is twisted before the first draw
            buf[12:16] = (1).to_bytes(4, "little")  # seeded
            buf[16:24] = bytes(8)
            buf[_MT_OFFSET:_MT_OFFSET + 8 * _MT_WORDS] = words.tobytes()
            buf[_MT_OFFSET + 8 * _MT_WORDS:] = bytes(len(buf) - _MT_OFFSET - 8 * _MT_WORDS)  # no cached normal
            gen.set_state(torch.frombuffer(buf, dtype=torch.uint8).clone())
            return gen
    gen.manual_seed(int.from_bytes(secret_bytes(secret, 8, "seed", *keys), "little") >> 1)
    return gen


def secret_numpy_state(secret: bytes, *keys: object) -> tuple:
    """A NumPy legacy ``RandomState`` state (``np.random.set_state``) whose 624 words come from ``secret`` and
    ``keys``: NumPy's global generator then draws a stream only the secret's holder can regenerate."""
    words = np.frombuffer(secret_bytes(secret, 4 * _MT_WORDS, *keys), dtype="<u4").astype(np.uint32)
    return ("MT19937", words.copy(), _MT_WORDS, 0, 0.0)


def noise_generator(ctx: Any, purpose: str, device: Any = None) -> torch.Generator:
    """The generator of a client's noise for ``purpose`` in its round: from the client's secret
    (``ctx.state.secret()``) when ``ctx.noise == "secret"``, else the seed-derived stream
    ``(seed, purpose, round, client)`` of ``fedsight.rng`` (what every simulated run draws)."""
    if getattr(ctx, "noise", "simulated") == "secret":
        if ctx.state is None:
            raise ValueError(f"{purpose}: secret noise needs the client's private state (its secret); none is attached")
        return secret_torch_gen(ctx.state.secret(), purpose, ctx.round, ctx.client_id, device=device)
    from .rng import derive_seed

    gen = torch.Generator(device=torch.device(device) if device is not None else torch.device("cpu"))
    gen.manual_seed(derive_seed(ctx.seed, purpose, ctx.round, ctx.client_id))
    return gen


_CLIENT_SECRETS = contextvars.ContextVar("fedsight_client_secrets", default=True)


@contextlib.contextmanager
def server_side() -> Iterator[None]:
    """Build the server's half inside this: a party that holds no client secret (a Flower ServerApp), so
    components do not read the clients' key files while the run is built (``holds_client_secrets``)."""
    token = _CLIENT_SECRETS.set(False)
    try:
        yield
    finally:
        _CLIENT_SECRETS.reset(token)


def holds_client_secrets() -> bool:
    """False inside ``server_side``: the party building the run holds none of the clients' secrets."""
    return _CLIENT_SECRETS.get()


def secret_users(stages: Any) -> list[str]:
    """The names of the components of ``stages`` whose noise or key protects a party (``uses_secrets``)."""
    return sorted({c.name for st in stages for c in st.recipe.components if getattr(c, "uses_secrets", False)})


def privacy_note(stages: Any, noise: str, also: tuple[str, ...] = ()) -> str | None:
    """What ``run.json`` records as ``privacy_noise`` for a run of ``stages`` under ``noise`` (``also``: other parts
    that draw protecting noise, such as central DP): None when nothing draws protecting noise or a key."""
    users = secret_users(stages) + list(also)
    return f"{note(noise)} ({', '.join(users)})" if users else None
