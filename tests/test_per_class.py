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


def test_client_label_counts_are_each_clients_training_labels():
    """The task's vectorised [clients, classes] counts against a per-client bincount of ``client_labels``, with
    local test sets carved out (they are not counted)."""
    import numpy as np

    from fedsight.api import build_task
    from fedsight.config import validate
    from helpers import tiny

    task = build_task(validate(tiny(**{"partition.local_test_fraction": 0.3, "partition.num_clients": 7})))
    assert any(task.num_test_examples(c) for c in range(7))
    want = np.stack([np.bincount(task.client_labels(c), minlength=task.num_classes) for c in range(7)])
    assert np.array_equal(task.client_label_counts(), want)
    assert want.sum() == sum(task.num_train_examples(c) for c in range(7))
