"""The reply contract on ``result.extras``: every built-in component that uploads extra tensors declares them
exactly (``Component.extras_spec``), honest runs of each are never rejected, and a client whose extras are of
the wrong shape or dtype, miss a name or a group, add one, hold NaN or values no honest client can send is
rejected (a ``rejected_update`` naming the client and the extra) while the run goes on and ends with exactly the
model (and server-side component state) of the run in which that client's reply never arrived."""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import sys
from typing import Any, Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsight.api import build_simulation
from fedsight.config import validate
from fedsight.engine.contract import check_result
from fedsight.engine.plan import Reply
from fedsight.plugins import load_builtin
from fedsight.training import Component

from helpers import tiny

load_builtin()

BASE = {"server.rounds": 2, "server.clients_per_round": 3, "eval.every": 2, "eval.local": False, "engine.threads": 1}
STREET = {"name": "street", "height": 32, "width": 48, "setting": "none", "cameras": ["car"]}
STYLES = {  # LADD's styles stage alone on generated street scenes (tests/recipe/test_ladd.py's setting)
    "seed": 0, "run": {"name": "styles"},
    "task": {"name": "segmentation", "crop": [24, 40], "scale": [0.8, 1.2], "labels": "eval_only"},
    "data": {**STREET, "towns": ["suburb", "rural"], "conditions": ["clear-day", "rain-day"], "per_domain": 3},
    "partition": {"name": "classes", "classes_per_client": 1, "num_clients": 4, "local_test_fraction": 0.0},
    "model": {"name": "bisenetv2", "width": 0.25, "head_channels": 16, "aux_channels": 8},
    "train": {"epochs": 1, "batch_size": 2, "lr": 0.02},
    "server": {"rounds": 1, "clients_per_round": 4}, "eval": {"batch_size": 4, "local": False, "every": 1},
    "engine": {"threads": 1},
    "stages": [{"name": "styles", "rounds": 1, "recipe": {"components": [{"name": "client_styles", "ks": [2, 3]}]}}],
}

#: name -> (config, the extras group its clients upload)
CONFIGS: dict[str, tuple[dict[str, Any], str]] = {
    "scaffold": (tiny(**BASE, **{"recipe.components": ["scaffold"], "recipe.weighting": "uniform"}), "scaffold"),
    "fednova": (tiny(**BASE, **{"recipe.components": [{"name": "fednova", "prox_mu": 0.1}, {"name": "fedprox", "mu": 0.1}],
                                "train.momentum": 0.5, "train.steps_range": [1, 4], "train.epochs": None}), "fednova"),
    "elastic": (tiny(**BASE, **{"recipe.components": ["elastic"]}), "elastic"),
    "elastic_element": (tiny(**BASE, **{"recipe.components": [{"name": "elastic", "granularity": "element"}]}),
                        "elastic"),
    "fed3r": (tiny(**BASE, **{"recipe.components": ["fed3r"]}), "fed3r"),
    "fed3r_sync": (tiny(**BASE, **{"recipe.components": [{"name": "fed3r", "sync": True}]}), "fed3r"),
    "fed3r_rf": (tiny(**BASE, **{"recipe.components": [{"name": "fed3r", "rff_dim": 12, "rff_sigma": 2.0,
                                                        "bias": False}]}), "fed3r"),
    "fedncm": (tiny(**BASE, **{"recipe.components": ["fedncm"]}), "fedncm"),
    "client_styles": (STYLES, "client_styles"),
}


def instrumented(name: str, tamper: Callable[[Any], None] | None = None, drop: bool = False):
    """A simulation of ``CONFIGS[name]`` whose first sampled client of round 1 (the victim) has its reply tampered
    with by ``tamper`` (after the honest client computed and kept it) or lost (``drop``); every round's contract
    and replies are logged (``sim.log``)."""
    sim = build_simulation(validate(copy.deepcopy(CONFIGS[name][0])))
    original, sim.log, sim.victim = sim.backend.train, [], None

    def train(plan):
        replies, events = original(plan)
        if plan.round == 1:
            sim.victim = plan.sampled[0]
        out = []
        for rep in replies:
            if plan.round == 1 and rep.client == sim.victim and rep.result is not None:
                if drop:
                    rep = Reply(rep.client, None, False, "gone")
                elif tamper is not None:
                    res = copy.deepcopy(rep.result)
                    tamper(res)
                    rep = dataclasses.replace(rep, result=res)
            out.append(rep)
        sim.log.append((plan.round, sim.server.contract(plan.round), copy.deepcopy(out)))
        return out, events

    sim.backend.train = train
    events: list[dict] = []
    sim.run(on_round=lambda r, row, ev: events.extend(ev))
    return sim, events


@functools.lru_cache(maxsize=None)
def honest(name: str):
    return instrumented(name)


@functools.lru_cache(maxsize=None)
def without_victim(name: str):
    return instrumented(name, drop=True)[0]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and \
            torch.equal(a.nan_to_num(-7.0), b.nan_to_num(-7.0))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def server_state(sim) -> dict[str, Any]:
    comps = {f"{st.name}/{c.name}": c.state_dict() for st in sim.stages for c in st.recipe.components}
    return {"model": sim.global_model.state_dict(), "facts": dict(sim.server.facts), **comps}


# -- declarations ------------------------------------------------------------------------------------------------


def test_every_builtin_component_declares_exactly_what_it_uploads():
    """``uploads_extras`` (what central DP reads) is set exactly by the built-in components that declare their
    extras; none relies on the unchecked default."""
    classes = {c for m in list(sys.modules.values()) if (getattr(m, "__name__", "") or "").startswith("fedsight.recipe")
               for _, c in inspect.getmembers(m, inspect.isclass) if issubclass(c, Component) and c is not Component}
    uploading = sorted(c.__name__ for c in classes if c.uploads_extras)
    assert {"Scaffold", "Elastic", "FedNova", "ClientStyles", "Fed3R", "FedNCM"} <= set(uploading)
    for cls in classes:
        declares = cls.extras_spec is not Component.extras_spec
        assert declares == cls.uploads_extras, cls.__name__


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_an_honest_run_is_never_rejected_and_its_extras_are_declared(name):
    sim, events = honest(name)
    group = CONFIGS[name][1]
    assert not [e for e in events if e["event"] in ("rejected_update", "client_lost")], events
    assert sim.log
    for r, contract, replies in sim.log:
        assert set(contract.extras) == {group} and contract.extras[group].tensors is not None
        for rep in replies:
            assert set(rep.result.extras) == {group}
            assert check_result(rep.result, rep.client, contract) is None


def test_each_stage_declares_its_own_extras():
    """A statistics stage (Fed3R) declares only its statistics, a later training stage SCAFFOLD's and FedNova's
    uploads: an honest two-stage run is never rejected, and a stage's group is refused in the other stage."""
    raw = tiny(**{**BASE, "server.rounds": 3})
    raw["stages"] = [{"name": "fed3r", "rounds": 2, "recipe": {"components": ["fed3r"]}},
                     {"name": "train", "rounds": 1, "recipe": {"components": ["scaffold", "fednova"]}}]
    sim = build_simulation(validate(raw))
    events, seen = [], []
    original = sim.backend.train
    sim.backend.train = lambda plan: (seen.append((plan.round, sim.server.contract(plan.round), original(plan))),
                                      seen[-1][2])[1]
    sim.run(on_round=lambda r, row, ev: events.extend(ev))
    assert not [e for e in events if e["event"] == "rejected_update"], events
    stats_round, train_round = seen[0], seen[-1]
    assert set(stats_round[1].extras) == {"fed3r"} and set(train_round[1].extras) == {"scaffold", "fednova"}
    stats = stats_round[2][0][0].result
    trained = train_round[2][0][0].result
    mixed = copy.deepcopy(trained)
    mixed.extras["fed3r"] = stats.extras["fed3r"]
    assert "unexpected group 'fed3r'" in check_result(mixed, mixed.client_id, train_round[1])
    del mixed.extras["fed3r"], mixed.extras["fednova"]
    assert "missing group 'fednova'" in check_result(mixed, mixed.client_id, train_round[1])


# -- tampering --------------------------------------------------------------------------------------------------


def _key(group: dict, floating: bool = False) -> str:
    keys = [k for k in sorted(group) if not floating or group[k].is_floating_point()]
    return keys[0]


def _other_dtype(t: torch.Tensor) -> torch.dtype:
    return {torch.float32: torch.float64, torch.float64: torch.float32}.get(t.dtype, torch.int32)


#: generic tampering of one result's group: name -> (edit(result, group name), what the reason must contain)
GENERIC: dict[str, Callable[[Any, str], str]] = {}


def generic(kind: str):
    def register(fn):
        GENERIC[kind] = fn
        return fn
    return register


@generic("wrong shape")
def _(res, g):
    k = _key(res.extras[g])
    t = res.extras[g][k]
    res.extras[g][k] = torch.zeros(t.numel() + 1, dtype=t.dtype)
    return f"extra {g}/{k} has shape"


@generic("wrong dtype")
def _(res, g):
    k = _key(res.extras[g])
    t = res.extras[g][k]
    res.extras[g][k] = t.to(_other_dtype(t))
    return f"extra {g}/{k} has dtype"


@generic("missing key")
def _(res, g):
    k = _key(res.extras[g])
    del res.extras[g][k]
    return f"extras {g!r}: missing {k!r}"


@generic("extra key")
def _(res, g):
    res.extras[g]["evil"] = torch.zeros(1)
    return f"extras {g!r}: unexpected 'evil'"


@generic("undeclared group")
def _(res, g):
    res.extras["evil"] = {"x": torch.zeros(1)}
    return "unexpected group 'evil'"


@generic("missing group")
def _(res, g):
    del res.extras[g]
    return f"missing group {g!r}"


@generic("nan")
def _(res, g):
    k = _key(res.extras[g], floating=True)
    res.extras[g][k] = torch.full_like(res.extras[g][k], float("nan"))
    return f"extra {g}/{k} has non-finite values"


@generic("not a tensor")
def _(res, g):
    k = _key(res.extras[g])
    res.extras[g][k] = [1.0]
    return f"extra {g}/{k} is a list"


def _fed3r_not_psd(res, g):
    s = res.extras[g]
    s["A"] = s["A"].clone()
    s["A"][0] = -1e3 * (s["A"][0].abs() + 1)  # the bias entry (last) stays the example count
    return "not positive semi-definite"


def _counts_off(res, g):
    s = res.extras[g]
    s["counts"] = s["counts"].clone()
    s["counts"][0] += 1
    return "counts sum to"


def _classes_out_of_range(res, g):
    s = res.extras[g]
    s["classes"] = s["classes"].clone()
    s["classes"][-1] = 10**6
    return "classes"


def _negate(key: str, reason: str):
    def edit(res, g):
        res.extras[g][key] = -res.extras[g][key].abs() - 1
        return reason
    return edit


def _negate_first(reason: str):
    def edit(res, g):
        k = _key(res.extras[g])
        res.extras[g][k] = -res.extras[g][k].abs() - 1
        return reason
    return edit


def _scale_a(res, g):
    res.extras[g]["a"] = res.extras[g]["a"] * 0.5
    return "a = "


#: tampering only a value check catches: config name -> {kind: edit}
SEMANTIC: dict[str, dict[str, Callable[[Any, str], str]]] = {
    "fednova": {"halved a": _scale_a},
    "elastic": {"negative sensitivity": _negate_first("negative sensitivity")},
    "elastic_element": {"negative sensitivity": _negate_first("negative sensitivity")},
    "fed3r": {"indefinite A": _fed3r_not_psd, "counts off": _counts_off, "class out of range": _classes_out_of_range},
    "fed3r_sync": {"indefinite A": _fed3r_not_psd, "class out of range": _classes_out_of_range},
    "fed3r_rf": {"indefinite A": _fed3r_not_psd, "counts off": _counts_off},
    "fedncm": {"counts off": _counts_off, "class out of range": _classes_out_of_range},
    "client_styles": {"negative style": _negate("style", "negative values")},
}

CASES = [(n, k) for n in sorted(CONFIGS) for k in sorted(GENERIC)] + \
        [(n, k) for n in sorted(SEMANTIC) for k in sorted(SEMANTIC[n])]


def _edit(name: str, kind: str) -> Callable[[Any, str], str]:
    return GENERIC.get(kind) or SEMANTIC[name][kind]


@pytest.mark.parametrize("name,kind", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_the_contract_rejects_a_tampered_extra_of_an_honest_reply(name, kind):
    """Every honest reply of the run, tampered with: rejected, with a reason naming the extra."""
    sim, _ = honest(name)
    group = CONFIGS[name][1]
    for _, contract, replies in sim.log:
        for rep in replies:
            res = copy.deepcopy(rep.result)
            want = _edit(name, kind)(res, group)
            why = check_result(res, rep.client, contract)
            assert why and want in why, (kind, why)


#: end-to-end: the run completes and equals the run without the victim (one generic and the semantic ones)
RUNS = [(n, "wrong shape") for n in sorted(CONFIGS)] + [("scaffold", "nan"), ("scaffold", "undeclared group"),
                                                        ("fed3r", "missing key"), ("elastic", "wrong dtype")] + \
       [(n, k) for n in sorted(SEMANTIC) for k in sorted(SEMANTIC[n])]


@pytest.mark.parametrize("name,kind", RUNS, ids=[f"{n}-{k}" for n, k in RUNS])
def test_a_tampered_extra_is_rejected_and_the_run_equals_the_run_without_that_client(name, kind):
    group = CONFIGS[name][1]
    reasons: list[str] = []
    sim, events = instrumented(name, tamper=lambda res: reasons.append(_edit(name, kind)(res, group)))
    rejected = [e for e in events if e["event"] == "rejected_update"]
    assert [(e["round"], e["client"]) for e in rejected] == [(1, sim.victim)], events
    assert reasons and reasons[0] in rejected[0]["reason"], rejected
    assert sim.round == sim.schedule.rounds
    ref = without_victim(name)
    assert ref.victim == sim.victim
    assert same(server_state(sim), server_state(ref))


# -- a component that declares nothing -----------------------------------------------------------------------


class Sketch(Component):
    """A third-party component that uploads extras without declaring them: the old check (finite named tensors)."""

    name = "sketch"
    uploads_extras = True

    def client_end(self, ctx, result):
        result.extras[self.name] = {"s": result.delta[next(iter(result.delta))].sum().reshape(1)}


def test_an_undeclared_component_keeps_the_old_check():
    sim = build_simulation(validate(tiny(**{**BASE, "server.rounds": 1})))
    sim.recipe.components.append(Sketch())
    captured = []
    original = sim.backend.train
    sim.backend.train = lambda plan: (captured.append((sim.server.contract(plan.round), original(plan))),
                                      captured[-1][1])[1]
    events = []
    sim.run(on_round=lambda r, row, ev: events.extend(ev))
    assert not [e for e in events if e["event"] == "rejected_update"], events
    contract, (replies, _) = captured[0]
    res = replies[0].result
    assert check_result(res, res.client_id, contract) is None
    res.extras["sketch"]["t"] = torch.ones(3, 2)  # any named finite tensor
    assert check_result(res, res.client_id, contract) is None
    res.extras["sketch"]["s"] = torch.tensor([float("inf")])
    assert "extra sketch/s has non-finite values" in check_result(res, res.client_id, contract)
    del res.extras["sketch"]
    assert check_result(res, res.client_id, contract) is None
    res.extras["other"] = {}
    assert "unexpected group 'other'" in check_result(res, res.client_id, contract)


# -- a property over random tampering --------------------------------------------------------------------------

EDITS = st.sampled_from(["shape", "dtype", "drop", "add", "nan", "inf", "rename_group", "scale"])


@settings(max_examples=80, deadline=None)
@given(name=st.sampled_from(sorted(CONFIGS)), edit=EDITS, pick=st.integers(0, 10**6), factor=st.floats(-1e6, 1e6))
def test_any_structural_change_to_an_honest_extra_is_rejected(name, edit, pick, factor):
    """Any change of an honest reply's extras that alters a name, a shape or a dtype, or brings a non-finite value,
    is rejected; multiplying a FedNova factor or a Fed3R class count by anything but 1 is too."""
    sim, _ = honest(name)
    group = CONFIGS[name][1]
    _, contract, replies = sim.log[pick % len(sim.log)]
    rep = replies[(pick // 7) % len(replies)]
    res = copy.deepcopy(rep.result)
    assert check_result(res, rep.client, contract) is None
    g = res.extras[group]
    keys = sorted(g)
    k = keys[(pick // 3) % len(keys)]
    t = g[k]
    if edit == "shape":
        dims = list(t.shape) or [1]
        dims[(pick // 11) % len(dims)] += 1 + pick % 3
        g[k] = torch.zeros(dims, dtype=t.dtype)
    elif edit == "dtype":
        g[k] = t.to(_other_dtype(t))
    elif edit == "drop":
        del g[k]
    elif edit == "add":
        g[f"{k}_"] = t.clone()
    elif edit in ("nan", "inf"):
        floating = [x for x in keys if g[x].is_floating_point() and g[x].numel()]
        k = floating[pick % len(floating)]
        flat = g[k].clone().reshape(-1)
        flat[pick % flat.numel()] = float(edit)
        g[k] = flat.reshape(g[k].shape)
    elif edit == "rename_group":
        res.extras[group + "_"] = res.extras.pop(group)
    elif edit == "scale":
        target = {"fednova": "a", "fed3r": "counts", "fed3r_sync": "counts", "fed3r_rf": "counts",
                  "fedncm": "counts"}.get(name)
        if target is None or abs(factor - 1.0) < 1e-6 or not bool(g[target].abs().sum() > 0):
            return
        g[target] = g[target] * factor
    assert check_result(res, rep.client, contract), (name, edit, k)
