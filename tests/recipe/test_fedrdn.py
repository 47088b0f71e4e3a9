"""FedRDN (``fedsight.recipe.fedrdn``): the statistics a client computes and uploads, the random normalisation of
its training images and the normalisation at evaluation, each against a hand computation from the raw pixels of
the dataset file (not through the task's standardisation, which the component undoes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import fedsight
from fedsight.api import build_task
from fedsight.config import validate
from fedsight.records import ClientResult
from fedsight.recipe.fedrdn import FedRDN
from fedsight.training import ClientContext, EvalContext

from helpers import tiny


@pytest.fixture
def task_and_raw(tmp_path):
    rng = np.random.default_rng(2)
    tr = rng.integers(0, 256, (48, 4, 4, 3), dtype=np.uint8)
    te = rng.integers(0, 256, (6, 4, 4, 3), dtype=np.uint8)
    np.savez(tmp_path / "rgb.npz", train_images=tr, train_labels=np.arange(48) % 3, test_images=te,
             test_labels=np.arange(6) % 3)
    raw = tiny(**{"data": {"name": "npz", "path": str(tmp_path / "rgb.npz")}, "partition.num_clients": 3,
                  "server.clients_per_round": 3, "run.output_dir": str(tmp_path / "runs")})
    return raw, build_task(validate(raw)), tr.transpose(0, 3, 1, 2) / 255.0, te.transpose(0, 3, 1, 2) / 255.0


def _hand_stats(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FedRDN step 1 by hand: each image's channel mean and population std, averaged over the images."""
    flat = images.reshape(len(images), 3, -1)
    return flat.mean(2).mean(0), flat.std(2).mean(0)


def _ctx(task, k, broadcast=None):
    return ClientContext(client_id=k, round=1, model=nn.Identity(), global_params={},
                         num_examples=task.num_train_examples(k), seed=0, task=task, broadcast=broadcast or {})


def test_client_statistics_upload_only_means_and_stds(task_and_raw):
    _, task, raw_train, _ = task_and_raw
    comp = FedRDN()
    for k in range(task.num_clients):
        ctx = _ctx(task, k)
        comp.client_start(ctx)
        result = ClientResult(client_id=k, num_examples=ctx.num_examples, delta={})
        comp.client_end(ctx, result)
        up = result.extras["fedrdn"]
        assert set(up) == {"mean", "std"} and all(v.shape == (3,) and v.dtype == torch.float32 for v in up.values())
        mean, std = _hand_stats(raw_train[task.clients[k].train])
        np.testing.assert_allclose(up["mean"].numpy(), mean, rtol=1e-5)
        np.testing.assert_allclose(up["std"].numpy(), std, rtol=1e-5)


def test_training_images_normalised_with_a_random_clients_pair(task_and_raw):
    _, task, raw_train, _ = task_and_raw
    bank = {"client": torch.tensor([0, 2]), "mean": torch.tensor([[0.1, 0.2, 0.3], [0.6, 0.5, 0.4]]),
            "std": torch.tensor([[0.2, 0.25, 0.3], [0.1, 0.15, 0.35]])}
    ctx = _ctx(task, 0, {"fedrdn": bank})  # client 0: its own pair (computed) and client 2's; the bank's row 0 is
    comp = FedRDN()                         # client 0's stale pair, which must not count twice
    comp.client_start(ctx)
    own_mean, own_std = _hand_stats(raw_train[task.clients[0].train])
    pairs = [(own_mean, own_std), (bank["mean"][1].numpy(), bank["std"][1].numpy())]
    n = task.num_train_examples(0)
    used = []
    for _ in range(20):
        pos = torch.arange(n)
        x, y = task.train_batch(0, pos)
        out, y2 = comp.transform_batch(ctx, x, y)
        assert torch.equal(y, y2)
        raw = raw_train[task.clients[0].train]
        for img, r in zip(out.numpy(), raw):
            hits = [j for j, (m, s) in enumerate(pairs)
                    if np.allclose(img, (r - m[:, None, None]) / s[:, None, None], rtol=1e-4, atol=1e-4)]
            assert len(hits) == 1
            used.append(hits[0])
    share = np.mean(used)  # uniform over the two clients: about half the images use client 2's pair
    assert 0.4 < share < 0.6


def test_evaluation_uses_the_clients_own_pair_or_the_banks_mean(task_and_raw):
    _, task, _, raw_test = task_and_raw
    comp = FedRDN()
    comp.bank = {0: (torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.2, 0.2, 0.2])),
                 1: (torch.tensor([0.3, 0.4, 0.5]), torch.tensor([0.4, 0.6, 0.2]))}
    seen = []
    model = nn.Identity()
    model.register_forward_hook(lambda mod, args, out: seen.append(out))
    x, _ = next(task.eval_batches("test"))
    with comp.eval_context(model, EvalContext(task=task, split="test", batch_size=64)):
        model(x)
    model(x)  # the hook is gone after the context
    m, s = np.array([0.2, 0.3, 0.4]), np.array([0.3, 0.4, 0.2])
    np.testing.assert_allclose(seen[0].numpy(), (raw_test - m[:, None, None]) / s[:, None, None], rtol=1e-4, atol=1e-5)
    assert torch.equal(seen[1], x)
    assert comp.eval_pair(1) is comp.bank[1]
    assert FedRDN().eval_pair("test") is None  # nothing reported yet: the task's own standardisation


def test_a_run_uploads_2c_float32_a_client_and_fills_the_bank(task_and_raw):
    raw, _, _, _ = task_and_raw
    one = {**raw, "server": {"rounds": 1, "clients_per_round": 3}, "eval": {"every": 1}}
    plain = fedsight.run(one)
    rdn = fedsight.run({**one, "recipe": {"components": ["fedrdn"]}, "run": {**raw["run"], "name": "rdn"}})
    assert rdn.status == "complete"
    # 3 clients x (mean, std) x 3 channels x 4 bytes: the pairs and nothing else beside the model update
    assert rdn.history[-1]["cost/up_bytes"] - plain.history[-1]["cost/up_bytes"] == 3 * 2 * 3 * 4


def test_the_bank_survives_a_checkpoint():
    comp = FedRDN()
    comp.bank = {4: (torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.2, 0.2, 0.2])),
                 1: (torch.tensor([0.3, 0.4, 0.5]), torch.tensor([0.4, 0.6, 0.2]))}
    again = FedRDN()
    again.load_state_dict(comp.state_dict())
    assert sorted(again.bank) == [1, 4]
    assert all(torch.equal(again.bank[k][i], comp.bank[k][i]) for k in comp.bank for i in (0, 1))
    empty = FedRDN()
    empty.load_state_dict(FedRDN().state_dict())
    assert empty.bank == {} and empty.server_broadcast(None) is None
