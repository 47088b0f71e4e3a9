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

``--task rdsn``: the same on PPFL-RDSN's own model, the example's RDSN (``examples/ppfl_rdsn.toml``: features
16, 2 blocks of 3 layers, growth 8, UDC; d = 28,806 parameters, |J| ~ 860 at p = 0.03) on its data (``builtin_sr``,
x2, 12 px LR patches of 48 px tiles of scikit-image's photographs, the whole training set one client's), trained with
Adam (lr 1e-3, batch 8; the example's ``local_adam``), the example's mark (p = 0.03, beta = 0.02, lam = 3000), L1
loss, quality as PSNR (Y, dB) on the example's "photos" test set instead of accuracy. The fine-tuning attack here
is also the answer to "does a model fine-tuned from the marked one still verify": it does (the mark survives what
the paper's Table III calls robustness), so the check detects a *substituted* model, not a tampered one.

The false-positive rate is reported with its exact (Clopper-Pearson) 95% interval (``scipy.stats.binomtest``), over
the unmarked scores at initialisation and after training (one model each contributes two, correlated, scores: the
interval over models is also printed).

One torch thread. Prints the distributions (mean, std, min, 1/50/99 % quantiles, max) and the rates.

    python benchmarks/watermark_stats.py [--unmarked 1000] [--marked 20] [--p 0.01] [--beta 0.1]
        [--model cnn --model-params '{"channels": [32, 64], "hidden": 128}'] [--noise-reading std]
    python benchmarks/watermark_stats.py --task rdsn [--unmarked 200 --marked 10]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

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


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ppfl_rdsn.toml"


class Digits:
    """The digits CNN: SGD with momentum 0.9, cross-entropy, test accuracy."""

    quality = "acc"
    defaults = {"p": 0.01, "beta": 0.1, "lam": None, "lr": 0.05, "batch_size": 32, "unmarked": 1000,
                "unmarked_steps": 5, "marked": 20, "mark_steps": 300, "finetune_steps": 300}

    def __init__(self, args):
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        d = load_digits()
        x = (d.images / 16.0).astype(np.float32)[:, None]
        xtr, xte, ytr, yte = train_test_split(x, d.target, test_size=0.2, random_state=args.seed, stratify=d.target)
        t = lambda a, dt: torch.as_tensor(a, dtype=dt)
        self.xtr, self.ytr, self.xte, self.yte = t(xtr, torch.float32), t(ytr, torch.long), t(xte, torch.float32), t(yte, torch.long)
        self.mparams = json.loads(args.model_params)
        self.name, self.lr, self.bs = args.model, args.lr, args.batch_size

    def describe(self) -> str:
        return f"model {self.name} {self.mparams} on digits"

    def make(self):
        return build_model(self.name, self.mparams, num_classes=10, in_channels=1, image_size=8)

    def optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9)

    def loss(self, model, gen):
        idx = torch.randint(0, len(self.xtr), (self.bs,), generator=gen)
        return F.cross_entropy(model(self.xtr[idx]), self.ytr[idx])

    @torch.no_grad()
    def score(self, model) -> float:
        model.eval()
        return float((model(self.xte).argmax(1) == self.yte).float().mean())


class Rdsn:
    """The example's RDSN on its data (module docstring): Adam, the task's L1 loss, PSNR on its "photos" test set."""

    quality = "psnr"
    defaults = {"p": 0.03, "beta": 0.02, "lam": 3000.0, "lr": 1e-3, "batch_size": 8, "unmarked": 200,
                "unmarked_steps": 20, "marked": 10, "mark_steps": 300, "finetune_steps": 300}

    def __init__(self, args):
        from fedsight.api import build_task
        from fedsight.config import read_toml, set_path, validate

        raw = read_toml(EXAMPLE)
        for k in ("variants", "sweep"):
            raw.pop(k, None)
        set_path(raw, ["partition", "num_clients"], 1)  # the whole training set: one model's data
        set_path(raw, ["server", "clients_per_round"], 1)
        self.cfg = validate(raw, str(EXAMPLE))
        self.task = build_task(self.cfg)
        self.lr, self.bs = args.lr, args.batch_size

    def describe(self) -> str:
        m = self.cfg.model.model_dump()
        return f"RDSN {m} (examples/ppfl_rdsn.toml) on builtin_sr x{self.task.scale}, {self.task.num_train_examples(0)} tiles"

    def make(self):
        return self.task.build_model()

    def optimizer(self, model):
        return torch.optim.Adam(model.parameters(), lr=self.lr)

    def loss(self, model, gen):
        n = self.task.num_train_examples(0)
        x, y = self.task.train_batch(0, torch.randint(0, n, (self.bs,), generator=gen))
        return self.task.loss(model(x), y)

    def score(self, model) -> float:
        return float(self.task.evaluate(model, "test", 1)["psnr"])


def train(model, work, steps, gen, carrier=None, lam=0.0, beta=0.0):
    opt = work.optimizer(model)
    model.train()
    for _ in range(steps):
        loss = work.loss(model, gen)
        if carrier is not None and lam > 0:
            loss = loss + lam * wm_loss(model, carrier, beta)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model


def describe(name: str, s: np.ndarray, thr: float, acc: list[float] | None = None) -> str:
    q = np.quantile(s, [0.01, 0.5, 0.99]) if len(s) else [float("nan")] * 3
    a = f"{np.mean(acc):7.3f}" if acc else "      -"
    return (f"{name:28} {len(s):5d} {s.mean():+9.5f} {s.std():8.5f} {s.min():+9.5f} {q[0]:+9.5f} {q[1]:+9.5f} "
            f"{q[2]:+9.5f} {s.max():+9.5f} {np.mean(s > thr):8.4f} {a}")


def rate(k: int, n: int) -> str:
    """k/n with its exact (Clopper-Pearson) 95% interval."""
    from scipy.stats import binomtest

    ci = binomtest(k, n).proportion_ci(0.95, method="exact")
    return f"{k} / {n} = {k / n:.4f} (95% CI {ci.low:.4f} to {ci.high:.4f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=["digits", "rdsn"], default="digits",
                    help="digits CNN, or the PPFL-RDSN example's RDSN on its SR data (defaults below differ)")
    ap.add_argument("--unmarked", type=int, default=None, help="unmarked (H0) models (digits 1000, rdsn 200)")
    ap.add_argument("--unmarked-steps", type=int, default=None, help="steps each unmarked model trains, no mark "
                    "(digits 5, rdsn 20)")
    ap.add_argument("--marked", type=int, default=None, help="marked (H1) models (digits 20, rdsn 10)")
    ap.add_argument("--mark-steps", type=int, default=None, help="steps with task loss + lam L_wm (300)")
    ap.add_argument("--finetune-steps", type=int, default=None, help="fine-tuning attack: steps without the mark (300)")
    ap.add_argument("--prune", type=float, default=0.7, help="pruning attack: fraction of weights zeroed (global L1)")
    ap.add_argument("--noise", type=float, default=1e-3, help="noise attack: the paper's N(0, 1e-3)")
    ap.add_argument("--noise-reading", choices=["variance", "std"], default="variance",
                    help="whether --noise is the variance (std = sqrt) or the std")
    ap.add_argument("--model", default="cnn", help="digits: registered classification model")
    ap.add_argument("--model-params", default='{"channels": [32, 64], "hidden": 128}', help="its parameters (JSON)")
    ap.add_argument("--p", type=float, default=None, help="carrier probability (digits 0.01, rdsn 0.03)")
    ap.add_argument("--beta", type=float, default=None, help="mark target of theta_j w_j (digits 0.1, rdsn 0.02)")
    ap.add_argument("--lam", type=float, default=None, help="lambda (digits |J|, rdsn 3000)")
    ap.add_argument("--threshold", type=float, default=None, help="accept S > threshold (default beta/2)")
    ap.add_argument("--lr", type=float, default=None, help="digits: SGD 0.05; rdsn: Adam 1e-3")
    ap.add_argument("--batch-size", type=int, default=None, help="digits 32, rdsn 8")
    ap.add_argument("--key", default=None, help="hex key (default: 32 bytes from --seed)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    kind = {"digits": Digits, "rdsn": Rdsn}[args.task]
    for k, v in kind.defaults.items():
        if getattr(args, k) is None and v is not None:
            setattr(args, k, v)
    torch.set_num_threads(1)

    t0 = time.perf_counter()
    work = kind(args)
    key = bytes.fromhex(args.key) if args.key else np.random.default_rng(args.seed).bytes(32)
    c = model_carrier(work.make(), key, args.p)
    lam = float(c.size) if args.lam is None else args.lam
    thr = args.beta / 2 if args.threshold is None else args.threshold
    std = paper_noise_std(args.noise_reading, args.noise)
    print(f"{work.describe()}: d = {c.d}, |J| = {c.size} (p = {args.p:g}), beta = {args.beta:g}, "
          f"lam = {lam:g}, threshold = {thr:g}; noise std = {std:.4g} ({args.noise_reading} reading of {args.noise:g})")
    if c.size < 500:
        print(f"note: |J| = {c.size} < 500 (the paper's minimum)")

    # -- H0: unmarked models --------------------------------------------------------------------------------
    s_init, s_trained, bounds = [], [], []
    t = time.perf_counter()
    for i in range(args.unmarked):
        torch.manual_seed(args.seed * 1_000_003 + i)
        m = work.make()
        s_init.append(wm_score(m, c))
        bounds.append(score_bound(m, c))
        train(m, work, args.unmarked_steps, torch.Generator().manual_seed(i))
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
        m = train(work.make(), work, args.mark_steps, gen, c, lam, args.beta)
        clean = {k: v.clone() for k, v in m.state_dict().items()}
        rows["clean"][0].append(wm_score(m, c))
        rows["clean"][1].append(work.score(m))
        train(m, work, args.finetune_steps, gen)
        rows["finetune"][0].append(wm_score(m, c))
        rows["finetune"][1].append(work.score(m))
        for name, state in (("prune", prune_magnitude(clean, args.prune, names=[k for k, p in m.named_parameters()
                                                                                 if p.dim() >= 2])),
                            ("noise", add_weight_noise(clean, std, gen, names=[k for k, _ in m.named_parameters()]))):
            m.load_state_dict(state)
            rows[name][0].append(wm_score(m, c))
            rows[name][1].append(work.score(m))
    t_h1 = time.perf_counter() - t

    # -- report ---------------------------------------------------------------------------------------------
    b = max(bounds) if bounds else float("nan")
    print()
    print(f"{'models':28} {'n':>5} {'mean S':>9} {'std':>8} {'min':>9} {'1%':>9} {'50%':>9} {'99%':>9} {'max':>9} "
          f"{'S > thr':>8} {work.quality:>7}")
    if args.unmarked:
        print(describe("unmarked, at init", s_init, thr))
        print(describe(f"unmarked, {args.unmarked_steps} steps", s_trained, thr))
    for name, label in (("clean", "marked"), ("finetune", f"marked + fine-tune {args.finetune_steps}"),
                        ("prune", f"marked + prune {args.prune:.0%}"), ("noise", f"marked + noise std {std:.3g}")):
        if args.marked:
            s, acc = rows[name]
            print(describe(label, np.array(s), thr, acc))
    print()
    if args.unmarked:
        both = np.concatenate([s_init, s_trained])
        fp = int((both > thr).sum())
        print(f"false-positive rate (unmarked scores): {rate(fp, len(both))}; S std {both.std():.5f} -> threshold "
              f"at {thr / both.std():.1f} std")
        either = int(((s_init > thr) | (s_trained > thr)).sum())
        print(f"unmarked models accepted at init or after training: {rate(either, len(s_init))}")
        print(f"Hoeffding bound exp(-|J| t^2 / (2 B^2)) with B = max |theta_j| over J of all unmarked models "
              f"= {b:.4f}: {hoeffding_false_positive(c.size, thr, b):.3e}  (the paper's exponent, 4x: "
              f"{math.exp(-2 * c.size * thr**2 / b**2):.3e})")
    if args.marked:
        kept = int((np.array(rows["finetune"][0]) > thr).sum())
        print(f"marked models that still verify after {args.finetune_steps} fine-tuning steps without the mark: "
              f"{rate(kept, args.marked)}" + (": a fine-tuned (tampered) model passes as the marked one" if kept else ""))
    print(f"time: unmarked {t_h0:.1f} s ({t_h0 / max(args.unmarked, 1) * 1e3:.1f} ms/model), marked+attacks {t_h1:.1f} s,"
          f" total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
