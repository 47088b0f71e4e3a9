"""False-positive and detection rates of PPFL-RDSN's parameter watermark (He & Joshi, section 3.3) on small models.

The paper reports no watermark statistic at all (digest section 4: no S, no detection or false-positive rate);
this measures them. Data: sklearn's 8x8 digits (1,437 training / 360 test images, pixels / 16). Model: a
registered classification model (default the built-in ``cnn``, channels 32-64, hidden 128: d = 53,002
parameters, |J| ~ 530 at p = 0.01). One key, one carrier set J (``fedsight.functional.watermark``); every model
below is scored with S = mean_{j in J} theta_j w_j and accepted when S > threshold (default beta/2).

* H0, unmarked: ``--unmarked`` models, each independently initialised (seed i), scored at initialisation and
  after ``--unmarked-steps`` SGD steps on the task without the mark. Their false-positive rate is compared with
  Hoeffding's bound exp(-|J| t^2 / (2 B^2)), B the largest |theta_j| over J seen in any unmarked model (a
  plug-in: the bound needs independent, zero-mean X_j = theta_j w_j in [-B, B]).
* H1, marked: ``--marked`` models trained ``--mark-steps`` steps on task loss + lam L_wm (lam default |J|), then
  attacked as in the paper's Table III: fine-tuning (``--finetune-steps`` steps without the mark), global
  magnitude pruning of ``--prune`` of the weights (>= 2-D parameters), Gaussian weight noise N(0, std^2) on every
  parameter, std = sqrt(--noise) with ``--noise-reading variance`` (the N(mu, sigma^2) notation, default) or
  --noise itself with ``std``. Detection rate = share with S > threshold; test accuracy alongside.

One torch thread. Prints the distributions (mean, std, min, 1/50/99 % quantiles, max) and the rates.

    python benchmarks/watermark_stats.py [--unmarked 1000] [--marked 20] [--p 0.01] [--beta 0.1]
        [--model cnn --model-params '{"channels": [32, 64], "hidden": 128}'] [--noise-reading std]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from fedsight.functional.watermark import (
    add_weight_noise,
    hoeffding_false_positive,
    model_carrier,
    paper_noise_std,
    prune_magnitude,
    score_bound,
    wm_loss,
    wm_score,
)
from fedsight.models import build_model


def digits(seed: int):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    xtr, xte, ytr, yte = train_test_split(x, d.target, test_size=0.2, random_state=seed, stratify=d.target)
    t = lambda a, dt: torch.as_tensor(a, dtype=dt)
    return t(xtr, torch.float32), t(ytr, torch.long), t(xte, torch.float32), t(yte, torch.long)


def train(model, x, y, steps, lr, bs, gen, carrier=None, lam=0.0, beta=0.0):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(x), (bs,), generator=gen)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        if carrier is not None and lam > 0:
            loss = loss + lam * wm_loss(model, carrier, beta)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model


@torch.no_grad()
def accuracy(model, x, y) -> float:
    model.eval()
    return float((model(x).argmax(1) == y).float().mean())


def describe(name: str, s: np.ndarray, thr: float, acc: list[float] | None = None) -> str:
    q = np.quantile(s, [0.01, 0.5, 0.99]) if len(s) else [float("nan")] * 3
    a = f"{np.mean(acc):7.3f}" if acc else "      -"
    return (f"{name:28} {len(s):5d} {s.mean():+9.5f} {s.std():8.5f} {s.min():+9.5f} {q[0]:+9.5f} {q[1]:+9.5f} "
            f"{q[2]:+9.5f} {s.max():+9.5f} {np.mean(s > thr):8.4f} {a}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--unmarked", type=int, default=1000, help="unmarked (H0) models")
    ap.add_argument("--unmarked-steps", type=int, default=5, help="SGD steps each unmarked model trains (no mark)")
    ap.add_argument("--marked", type=int, default=20, help="marked (H1) models")
    ap.add_argument("--mark-steps", type=int, default=300, help="steps with task loss + lam L_wm")
    ap.add_argument("--finetune-steps", type=int, default=300, help="fine-tuning attack: steps without the mark")
    ap.add_argument("--prune", type=float, default=0.7, help="pruning attack: fraction of weights zeroed (global L1)")
    ap.add_argument("--noise", type=float, default=1e-3, help="noise attack: the paper's N(0, 1e-3)")
    ap.add_argument("--noise-reading", choices=["variance", "std"], default="variance",
                    help="whether --noise is the variance (std = sqrt) or the std")
    ap.add_argument("--model", default="cnn", help="registered classification model")
    ap.add_argument("--model-params", default='{"channels": [32, 64], "hidden": 128}', help="its parameters (JSON)")
    ap.add_argument("--p", type=float, default=0.01, help="carrier probability")
    ap.add_argument("--beta", type=float, default=0.1, help="mark target of theta_j w_j")
    ap.add_argument("--lam", type=float, default=None, help="lambda (default |J|)")
    ap.add_argument("--threshold", type=float, default=None, help="accept S > threshold (default beta/2)")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--key", default=None, help="hex key (default: 32 bytes from --seed)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)

    t0 = time.perf_counter()
    xtr, ytr, xte, yte = digits(args.seed)
    mparams = json.loads(args.model_params)
    make = lambda: build_model(args.model, mparams, num_classes=10, in_channels=1, image_size=8)
    key = bytes.fromhex(args.key) if args.key else np.random.default_rng(args.seed).bytes(32)
    c = model_carrier(make(), key, args.p)
    lam = float(c.size) if args.lam is None else args.lam
    thr = args.beta / 2 if args.threshold is None else args.threshold
    std = paper_noise_std(args.noise_reading, args.noise)
    print(f"model {args.model} {mparams}: d = {c.d}, |J| = {c.size} (p = {args.p:g}), beta = {args.beta:g}, "
          f"lam = {lam:g}, threshold = {thr:g}; noise std = {std:.4g} ({args.noise_reading} reading of {args.noise:g})")
    if c.size < 500:
        print(f"note: |J| = {c.size} < 500 (the paper's minimum)")

    # -- H0: unmarked models --------------------------------------------------------------------------------
    s_init, s_trained, bounds = [], [], []
    t = time.perf_counter()
    for i in range(args.unmarked):
        torch.manual_seed(args.seed * 1_000_003 + i)
        m = make()
        s_init.append(wm_score(m, c))
        bounds.append(score_bound(m, c))
        train(m, xtr, ytr, args.unmarked_steps, args.lr, args.batch_size, torch.Generator().manual_seed(i))
        s_trained.append(wm_score(m, c))
        bounds.append(score_bound(m, c))
    t_h0 = time.perf_counter() - t
    s_init, s_trained = np.array(s_init), np.array(s_trained)

    # -- H1: marked models under attack ---------------------------------------------------------------------
    t = time.perf_counter()
    rows: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in ("clean", "finetune", "prune", "noise")}
    for i in range(args.marked):
        torch.manual_seed(10**9 + args.seed * 1_000_003 + i)
        gen = torch.Generator().manual_seed(10**6 + i)
        m = train(make(), xtr, ytr, args.mark_steps, args.lr, args.batch_size, gen, c, lam, args.beta)
        clean = {k: v.clone() for k, v in m.state_dict().items()}
        rows["clean"][0].append(wm_score(m, c))
        rows["clean"][1].append(accuracy(m, xte, yte))
        train(m, xtr, ytr, args.finetune_steps, args.lr, args.batch_size, gen)
        rows["finetune"][0].append(wm_score(m, c))
        rows["finetune"][1].append(accuracy(m, xte, yte))
        for name, state in (("prune", prune_magnitude(clean, args.prune, names=[k for k, p in m.named_parameters()
                                                                                 if p.dim() >= 2])),
                            ("noise", add_weight_noise(clean, std, gen, names=[k for k, _ in m.named_parameters()]))):
            m.load_state_dict(state)
            rows[name][0].append(wm_score(m, c))
            rows[name][1].append(accuracy(m, xte, yte))
    t_h1 = time.perf_counter() - t

    # -- report ---------------------------------------------------------------------------------------------
    b = max(bounds) if bounds else float("nan")
    print()
    print(f"{'models':28} {'n':>5} {'mean S':>9} {'std':>8} {'min':>9} {'1%':>9} {'50%':>9} {'99%':>9} {'max':>9} "
          f"{'S > thr':>8} {'acc':>7}")
    if args.unmarked:
        print(describe("unmarked, at init", s_init, thr))
        print(describe(f"unmarked, {args.unmarked_steps} SGD steps", s_trained, thr))
    for name, label in (("clean", "marked"), ("finetune", f"marked + fine-tune {args.finetune_steps}"),
                        ("prune", f"marked + prune {args.prune:.0%}"), ("noise", f"marked + noise std {std:.3g}")):
        if args.marked:
            s, acc = rows[name]
            print(describe(label, np.array(s), thr, acc))
    print()
    if args.unmarked:
        both = np.concatenate([s_init, s_trained])
        fp = int((both > thr).sum())
        # one-sided 95% upper confidence bound of the false-positive rate (Clopper-Pearson)
        from scipy.stats import beta as beta_dist

        upper = float(beta_dist.ppf(0.95, fp + 1, len(both) - fp)) if fp < len(both) else 1.0
        print(f"false positives: {fp} / {len(both)} unmarked scores (95% upper bound {upper:.2e}); "
              f"S std {both.std():.5f} -> threshold at {thr / both.std():.1f} std")
        print(f"Hoeffding bound exp(-|J| t^2 / (2 B^2)) with B = max |theta_j| over J of all unmarked models "
              f"= {b:.4f}: {hoeffding_false_positive(c.size, thr, b):.3e}  (the paper's exponent, 4x: "
              f"{math.exp(-2 * c.size * thr**2 / b**2):.3e})")
    print(f"time: unmarked {t_h0:.1f} s ({t_h0 / max(args.unmarked, 1) * 1e3:.1f} ms/model), marked+attacks {t_h1:.1f} s,"
          f" total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
