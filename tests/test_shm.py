"""``fedsight.distributed.shm``: a message written into one direction's segment is read back byte for byte, a
larger one makes the next generation, names are removed once attached, and a segment the shared-memory file system
cannot hold is refused (the message then goes over gloo) instead of being written into (SIGBUS). The two ranks'
sides run in one process here; ``tests/test_distributed.py`` runs them in two under torchrun."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch

from fedsight.distributed import shm

pytestmark = pytest.mark.skipif(not Path(shm.SHM_DIR).is_dir(), reason="no /dev/shm")


def _names(prefix: str) -> list[str]:
    return sorted(p.name for p in Path(shm.SHM_DIR).glob(f"{prefix}*"))


def test_messages_cross_byte_for_byte_and_a_larger_one_makes_the_next_generation():
    prefix = f"fedsight-test-{uuid.uuid4().hex[:8]}"
    w, r = shm.Writer(prefix), shm.Reader(prefix)
    try:
        gen, buf = w.buffer(1000)
        assert gen == 1 and buf.numel() == 1000 and _names(prefix) == [f"{prefix}-1"]
        data = torch.randint(0, 256, (1000,), dtype=torch.uint8)
        buf.copy_(data)
        got = r.read(gen, 1000)
        assert torch.equal(got, data) and _names(prefix) == []  # attached: the name is gone, the mapping stays
        gen2, buf2 = w.buffer(1400)  # within the 1.5x room: the same segment
        assert gen2 == 1
        buf2.copy_(torch.arange(1400) % 251)
        assert torch.equal(r.read(gen2, 1400), (torch.arange(1400) % 251).to(torch.uint8))
        assert torch.equal(got, data)  # the first message was copied out: the segment's reuse leaves it alone
        gen3, buf3 = w.buffer(5000)
        assert gen3 == 2 and _names(prefix) == [f"{prefix}-2"]
        buf3.fill_(7)
        assert torch.equal(r.read(gen3, 5000), torch.full((5000,), 7, dtype=torch.uint8))
    finally:
        w.close(unlink=True)
        r.close()
    assert _names(prefix) == []


def test_a_segment_the_file_system_cannot_hold_is_refused(monkeypatch):
    class Full:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Full())
    w = shm.Writer(f"fedsight-test-{uuid.uuid4().hex[:8]}")
    assert w.buffer(100_000) is None  # 150,000 bytes asked, 40,960 free
    assert w.buffer(1000) is not None
    w.close(unlink=True)


@pytest.mark.parametrize("env,on", [({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}, True),
                                    ({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"}, False),
                                    ({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}, False),
                                    ({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2",
                                      "FEDSIGHT_DIST_SHM": "0"}, False)])
def test_used_only_when_every_rank_is_on_this_machine_and_not_turned_off(monkeypatch, env, on):
    for k in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "FEDSIGHT_DIST_SHM"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert shm.enabled() is on
