"""How the distributed backend's messages are packed (``fedsight.distributed.wire``): a pickled header and one flat
buffer give back every tensor bit for bit, in its dtype and shape, as views of the buffer; a rank's uploads are
sealed on rank 0 only when every floating-point value of the message is finite. The transfers themselves run in
``tests/test_distributed.py``'s torchrun session (every message of its runs crosses through ``wire``)."""

from __future__ import annotations

import pickle

import pytest
import torch

from fedsight.distributed import wire
from fedsight.distributed.engine import _sealed
from fedsight.engine.contract import FiniteSeal
from fedsight.engine.plan import Reply
from fedsight.records import ClientResult


def _message() -> dict:
    g = torch.Generator().manual_seed(0)
    stack = torch.randn(4, 3, 5, generator=g)
    a = torch.arange(7)
    return {
        "row": stack[2],  # a row of a larger stack: only its own elements travel
        "strided": torch.randn(6, 4, generator=g).t(),
        "double": torch.randn(3, dtype=torch.float64, generator=g),
        "half": torch.randn(5, generator=g).to(torch.bfloat16),
        "bool": torch.tensor([True, False, True]),
        "int": a,
        "same_int": a,  # one tensor twice: sent once, one object on arrival
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "complex": torch.randn(3, dtype=torch.complex64, generator=g).conj(),
        "needs_grad": torch.ones(2, requires_grad=True),
        "param": torch.nn.Parameter(torch.full((2,), 3.0)),
        "text": ["not a tensor", 4, None],
    }


def _bytes(t: torch.Tensor) -> list[int]:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).tolist()


def test_every_tensor_comes_back_bit_for_bit_in_its_dtype_and_shape() -> None:
    sent = _message()
    header, buf = wire.pack(sent)
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    got = wire.unpack(header, buf)
    for key, value in sent.items():
        if not isinstance(value, torch.Tensor):
            assert got[key] == value
            continue
        want = value.detach().resolve_conj()
        assert got[key].dtype == want.dtype and got[key].shape == want.shape, key
        # bit for bit: the bytes, not just equal values
        assert _bytes(got[key]) == _bytes(want), key
    assert got["same_int"] is got["int"]
    assert not got["needs_grad"].requires_grad  # detached, as every tensor crossing ranks was
    assert type(got["param"]) is torch.nn.Parameter  # a subclass is pickled in the header as before
    # a row of a stack: only its own 15 numbers travel, not the stack's 60
    assert wire.pack({"row": torch.zeros(4, 3, 5)[2]})[1].numel() == 15 * 4


def test_received_tensors_are_aligned_views_of_the_buffer_grouped_by_dtype() -> None:
    header, buf = wire.pack(_message())
    got = wire.unpack(header, buf)
    base = buf.untyped_storage().data_ptr()
    for key in ("row", "double", "int", "complex", "half"):
        t = got[key]
        assert t.untyped_storage().data_ptr() == base, key  # a view, no copy
        assert (t.data_ptr() - base) % t.element_size() == 0, key
    _, _, sections = pickle.loads(header)
    # each dtype one section, the sections apart
    spans = sorted(sections.values())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert all(start % wire.ALIGN == 0 for start, _ in spans)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.complex64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_value_anywhere_in_the_message_is_found(dtype: torch.dtype, bad: float) -> None:
    msg = _message()
    header, buf = wire.pack(msg)
    assert wire.finite_sections(header, buf)
    poisoned = torch.zeros(9, dtype=dtype)
    poisoned[7] = bad
    header, buf = wire.pack({**msg, "late": poisoned})
    assert not wire.finite_sections(header, buf)


def _replies() -> list[Reply]:
    def result(cid: int, value: float) -> ClientResult:
        return ClientResult(cid, 3, {"w": torch.full((4,), value)}, {"b": torch.ones(2)}, {"train/loss": 0.5})

    return [Reply(0, result(0, 1.0)), Reply(1, result(1, 2.0), accepted=False, reason="x"), Reply(2, None)]


def test_rank_0_seals_a_rank_s_accepted_uploads_only_when_its_message_is_finite() -> None:
    header, buf = wire.pack(_replies())
    replies = wire.unpack(header, buf)
    sealed = _sealed(replies, wire.finite_sections(header, buf))
    assert isinstance(sealed[0].finite_seal, FiniteSeal) and sealed[0].finite_seal.holds(sealed[0].result)
    assert sealed[1].finite_seal is None and sealed[2].finite_seal is None  # refused by its client; no result
    # one non-finite number in any upload of the message: nothing sealed, the server checks every upload
    bad = _replies()
    bad[1].result.delta["w"][2] = float("nan")
    header, buf = wire.pack(bad)
    assert all(r.finite_seal is None for r in _sealed(wire.unpack(header, buf), wire.finite_sections(header, buf)))
