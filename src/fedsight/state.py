"""Per-client state that does not grow memory with the number of clients.

Stateful methods (SCAFFOLD's client control variate, FedDyn's linear term, FedBN's local normalisation
layers, personal heads) keep one small tensor dict per (key, client). The store keeps only an index in
RAM (client -> round of its latest version); tensors live in safetensors files under the run directory
and are read only for the clients sampled in a round:

    RUN_DIR/client_state/<key>/<client:07d>-r<round:06d>.safetensors

Writes are copy-on-write: a new version never overwrites the one the last checkpoint refers to. The
index (with each version's SHA-256) is part of the engine's checkpoint; after the checkpoint of round r commits,
versions superseded in round r are deleted (``commit``); on resume, every version the checkpoint refers to is
checked (present, same SHA-256) before versions newer than the checkpoint are deleted (``load_state_dict``), so a
damaged or missing file stops the resume before anything changes. Without a run directory (tests, benchmarks)
the store keeps tensors in memory.

The store also keeps its clients' secrets (``secret``; ``fedsight.secret``): 32 bytes each from the OS CSPRNG,

    RUN_DIR/client_state/secret/<name>.key

written once when first needed and never versioned or rewritten. The checkpoint holds their names only (the
clients that drew one, ``secret_clients``), never their bytes; a resumed run checks that each named file is there
and whole before anything changes and reads it back, so its noise is the uninterrupted run's. ``one_client``: the store of a
single client (a Flower node's), which cannot hold a secret shared by several clients (``shared_secret``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load, save

from .errors import RunFileError
from .runs import atomic_write_bytes

#: client-state key of a client's personal (non-shared) model entries
PERSONAL = "personal"


#: the store's folder of secrets (``ClientStateStore.secret``); no component's state key may take it
SECRET_DIR = "secret"


class ClientStateStore:
    def __init__(self, root: str | Path | None = None, *, one_client: bool = False):
        self.root = Path(root) if root is not None else None
        self.one_client = one_client
        self._secrets: dict[str, bytes] = {}  # without a folder: the secrets themselves
        self._secret_names: set[str] = set()  # with a folder: the names drawn or read (checkpointed)
        self._index: dict[str, dict[int, int]] = {}  # key -> client -> round of the current version
        self._sha: dict[tuple[str, int], bytes] = {}  # (key, client) -> SHA-256 of the current version's file
        self._mem: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        self._superseded: list[Path] = []

    def _path(self, key: str, client: int, round: int) -> Path:
        assert self.root is not None
        return self.root / key / f"{client:07d}-r{round:06d}.safetensors"

    def get(self, key: str, client: int) -> dict[str, torch.Tensor] | None:
        rnd = self._index.get(key, {}).get(client)
        if rnd is None:
            return None
        if self.root is None:
            return {k: v.clone() for k, v in self._mem[(key, client)].items()}
        return load(self._read(key, client, rnd))

    def _read(self, key: str, client: int, rnd: int) -> bytes:
        """The bytes of a version, checked against its recorded SHA-256 (versions of checkpoints written before
        the hashes were recorded have none)."""
        path = self._path(key, client, rnd)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise RunFileError(f"{path}: client state missing (was the run directory pruned?)") from None
        except OSError as exc:
            raise RunFileError(f"{path}: cannot read client state ({exc.strerror or exc})") from None
        sha = self._sha.get((key, client))
        if sha is not None and hashlib.sha256(data).digest() != sha:
            raise RunFileError(f"{path}: damaged client state (its SHA-256 differs from the checkpoint's)")
        return data

    def put(self, key: str, client: int, round: int, tensors: dict[str, torch.Tensor]) -> None:
        if "/" in key or not key or key == SECRET_DIR:
            raise ValueError(f"invalid client-state key {key!r}")
        old = self._index.setdefault(key, {}).get(client)
        if self.root is None:
            self._mem[(key, client)] = {k: v.detach().cpu().clone() for k, v in tensors.items()}
        else:
            data = save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
            atomic_write_bytes(self._path(key, client, round), data)
            self._sha[(key, client)] = hashlib.sha256(data).digest()
            if old is not None and old != round:
                self._superseded.append(self._path(key, client, old))
        self._index[key][client] = round

    def clients(self, key: str) -> list[int]:
        return sorted(self._index.get(key, {}))

    def secret(self, name: str) -> bytes:
        """The secret ``name`` (``client-0000003``, ``watermark``): read back from ``secret/<name>.key`` under the
        store's folder, or drawn from the OS CSPRNG the first time and written there (in memory without a folder)."""
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"invalid secret name {name!r}")
        from .secret import draw_secret, keep_secret

        if self.root is not None:  # read from its file each time: memory does not grow with the clients
            data = keep_secret(self.root / SECRET_DIR / f"{name}.key", must_exist=name in self._secret_names)
            self._secret_names.add(name)
            return data
        if name not in self._secrets:
            self._secrets[name] = draw_secret()
        return self._secrets[name]

    def keys(self) -> list[str]:
        """The kinds of state held (``PERSONAL``, components' names), for any client."""
        return sorted(self._index)

    def commit(self) -> None:
        """Delete versions superseded since the last commit (call after a checkpoint is written)."""
        for p in self._superseded:
            p.unlink(missing_ok=True)
        self._superseded.clear()

    # -- checkpoint -------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        out = {}
        for key, idx in self._index.items():
            clients = sorted(idx)
            out[key] = {
                "clients": torch.tensor(clients, dtype=torch.int64),
                "rounds": torch.tensor([idx[c] for c in clients], dtype=torch.int64),
            }
            if self.root is not None and all((key, c) in self._sha for c in clients):
                out[key]["sha256"] = torch.tensor([list(self._sha[(key, c)]) for c in clients],
                                                  dtype=torch.uint8).reshape(len(clients), 32)
            if self.root is None:
                out[key]["memory"] = {str(c): self._mem[(key, c)] for c in clients}
        if self.root is not None and self._secret_names:  # names only: the bytes stay in their files
            out[SECRET_DIR] = {"names": sorted(self._secret_names)}
        return out

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        names = [str(n) for n in (state.pop(SECRET_DIR, None) or {}).get("names", [])]
        self._index = {
            key: dict(zip(v["clients"].tolist(), v["rounds"].tolist(), strict=True)) for key, v in state.items()
        }
        self._superseded.clear()
        if self.root is None:
            self._mem = {(key, int(c)): t for key, v in state.items() for c, t in v.get("memory", {}).items()}
            return
        self._sha = {(key, int(c)): bytes(h.tolist()) for key, v in state.items() if "sha256" in v
                     for c, h in zip(v["clients"].tolist(), v["sha256"], strict=True)}
        missing = [self._path(k, c, r) for k, idx in self._index.items() for c, r in idx.items()
                   if not self._path(k, c, r).is_file()]
        if missing:  # checked before anything is deleted
            raise RunFileError(f"{missing[0]}: client state missing ({len(missing)} files the checkpoint refers to)")
        for k, idx in self._index.items():
            for c, r in idx.items():
                self._read(k, c, r)
        from .secret import check_secret

        for name in names:  # a secret the run drew must be there: a new draw would silently change the noise
            check_secret(self.root / SECRET_DIR / f"{name}.key")
        self._secret_names = set(names)
        # versions written after the checkpoint (a killed round) are orphans: remove them
        for key_dir in self.root.glob("*") if self.root.is_dir() else []:
            idx = self._index.get(key_dir.name, {})
            for f in key_dir.glob("*.safetensors"):
                client, rnd = f.stem.split("-r")
                if idx.get(int(client)) != int(rnd):
                    f.unlink()
