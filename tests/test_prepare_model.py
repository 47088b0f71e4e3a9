"""``prepare_model`` (run for every client) against torch's own walks: ``named_parameters`` for which parameter
trains, ``named_modules`` for which module is in training mode."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fedsight.training.local import prepare_model


def _model() -> nn.Module:
    """A tied weight (one parameter under two names: torch names it once, by the first), a norm layer, a
    parameter-free module and a bias-free Linear."""
    enc = nn.Linear(3, 3)
    model = nn.Sequential(enc, nn.BatchNorm1d(3), nn.ReLU(), nn.Linear(3, 3, bias=False), nn.Linear(3, 3))
    model[4].weight = enc.weight
    return model


@settings(max_examples=60, deadline=None)
@given(frozen_mask=st.lists(st.booleans(), min_size=7, max_size=7), eval_mask=st.lists(st.booleans(), min_size=6,
       max_size=6), grads=st.lists(st.booleans(), min_size=7, max_size=7))
def test_prepare_model_freezes_by_name_and_trains_every_other_module(frozen_mask, eval_mask, grads):
    model = _model()
    every = [k for k, _ in model.named_parameters(remove_duplicate=False)]  # 7 names, "4.weight" the tied one
    assert len(every) == 7
    for (_, p), g in zip(model.named_parameters(), grads):
        p.requires_grad_(g)
    for m, e in zip(model.modules(), eval_mask):
        m.train(not e)
    frozen = {k for k, f in zip(every, frozen_mask) if f}
    prepare_model(model, frozen)
    for k, p in model.named_parameters():
        assert p.requires_grad == (k not in frozen), k
    norm_frozen = {"1.weight", "1.bias"} <= frozen
    for name, m in model.named_modules():
        assert m.training == (not (name == "1" and norm_frozen)), name
