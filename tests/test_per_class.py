"""Per-class accuracy of classification runs (``acc/<class>``), against scikit-learn's per-class recall."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import recall_score

from fedsight.tasks.classification import classification_metrics


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 6), st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=60),
       st.integers(1, 4))
def test_per_class_accuracy_is_sklearns_recall_however_the_batches_and_clients_split(c, pairs, parts):
    pairs = [(t % c, p % c) for t, p in pairs]
    targets = torch.tensor([t for t, _ in pairs])
    preds = torch.tensor([p for _, p in pairs])
    names = [f"k{i}" for i in range(c)]
    metrics = classification_metrics(c, names)
    per_class = metrics.metrics[2]
    states = []
    for chunk in np.array_split(np.arange(len(pairs)), parts):  # clients' states, merged on the server
        state = metrics.new_state()
        if len(chunk):
            per_class.update(state, preds[chunk], targets[chunk])
        states.append(state)
    got = metrics.compute(metrics.merge(states))
    present = sorted(set(targets.tolist()))
    ref = recall_score(targets.numpy(), preds.numpy(), labels=present, average=None, zero_division=0)
    assert {k: v for k, v in got.items() if k.startswith("acc/")} == pytest.approx(
        {f"acc/k{c_}": r for c_, r in zip(present, ref)}, abs=1e-12)
    assert metrics.higher_is_better("acc/k0") is True
