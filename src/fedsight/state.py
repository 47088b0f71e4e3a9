"""Per-client state that does not grow memory with the number of clients.

Stateful methods (SCAFFOLD's client control variate, FedDyn's linear term, FedBN's local normalisation
layers, personal heads) keep one small tensor dict per (key, client). The store keeps only an index in
RAM (client -> round of its latest version); tensors live in safetensors files under the run directory
and are read only for the clients sampled in a round:

    RUN_DIR/client_state/<key>/<client:07d>-r<round:06d>.safetensors

Writes are copy-on-write: a new version never overwrites the one the last checkpoint refers to. The
index is part of the engine's checkpoint; after the checkpoint of round r commits, versions superseded
in round r are deleted (``commit``); on resume, versions newer than the checkpoint are deleted
(``load_state_dict``). Without a run directory (tests, benchmarks) the store keeps tensors in memory.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .errors import RunFileError

#: client-state key of a client's personal (non-shared) model entries
PERSONAL = "personal"


class ClientStateStore:
    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root is not None else None
        self._index: dict[str, dict[int, int]] = {}  # key -> client -> round of the current version
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
        path = self._path(key, client, rnd)
        try:
            return load_file(str(path))
        except FileNotFoundError:
            raise RunFileError(f"{path}: client state missing (was the run directory pruned?)") from None
        except (SafetensorError, OSError) as exc:
            raise RunFileError(f"{path}: damaged client state ({' '.join(str(exc).split())[:120]})") from None

    def put(self, key: str, client: int, round: int, tensors: dict[str, torch.Tensor]) -> None:
        if "/" in key or not key:
            raise ValueError(f"invalid client-state key {key!r}")
        old = self._index.setdefault(key, {}).get(client)
        if self.root is None:
            self._mem[(key, client)] = {k: v.detach().cpu().clone() for k, v in tensors.items()}
        else:
            path = self._path(key, client, round)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
            tmp.replace(path)
            if old is not None and old != round:
                self._superseded.append(self._path(key, client, old))
        self._index[key][client] = round

    def clients(self, key: str) -> list[int]:
        return sorted(self._index.get(key, {}))

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
            if self.root is None:
                out[key]["memory"] = {str(c): self._mem[(key, c)] for c in clients}
        return out

    def load_state_dict(self, state: dict) -> None:
        self._index = {
            key: dict(zip(v["clients"].tolist(), v["rounds"].tolist(), strict=True)) for key, v in state.items()
        }
        self._superseded.clear()
        if self.root is None:
            self._mem = {(key, int(c)): t for key, v in state.items() for c, t in v.get("memory", {}).items()}
            return
        missing = [self._path(k, c, r) for k, idx in self._index.items() for c, r in idx.items()
                   if not self._path(k, c, r).is_file()]
        if missing:  # checked before anything is deleted
            raise RunFileError(f"{missing[0]}: client state missing ({len(missing)} files the checkpoint refers to)")
        # versions written after the checkpoint (a killed round) are orphans: remove them
        for key_dir in self.root.glob("*") if self.root.is_dir() else []:
            idx = self._index.get(key_dir.name, {})
            for f in key_dir.glob("*.safetensors"):
                client, rnd = f.stem.split("-r")
                if idx.get(int(client)) != int(rnd):
                    f.unlink()
