"""Tracing a model's forward (``torch.fx``) into a ``fused.FusedPlan``: which layers, functions and methods the fused
forward computes, and the checks that refuse a plan where it would not compute what each client's own module does
(``fused``'s docstring says what the plan computes and how)."""

from __future__ import annotations

import inspect
import operator
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..models.cnn import GridPool
from ..models.rdsn import apply_udc
from ..models.rdsn_etc import pad_to
from .fused import _ACTIVATIONS, _BINARY, _ELEMENTWISE, CONST, DTYPE, SHAPE, FusedPlan, Step

_LEAVES = (nn.Conv2d, nn.Linear, nn.BatchNorm1d, nn.BatchNorm2d, nn.GroupNorm, nn.MaxPool2d, nn.AvgPool2d,
           nn.AdaptiveAvgPool2d, GridPool, nn.Flatten, nn.Dropout, nn.PixelShuffle, *_ACTIVATIONS)
#: functions and methods the fused forward computes, by the step they become
_FUNCTIONS = {operator.add: "add", torch.add: "add", operator.sub: "sub", torch.sub: "sub", operator.mul: "mul",
              torch.mul: "mul", torch.relu: "relu", F.relu: "relu", torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid",
              torch.flatten: "flatten", torch.cat: "cat", F.interpolate: "interpolate", torch.mean: "mean",
              torch.amax: "amax", getattr: "getattr", operator.getitem: "getitem",
              F.adaptive_avg_pool2d: "adaptive_avg_pool2d", apply_udc: "udc", pad_to: "pad_to"}
_METHODS = {"relu": "relu", "sigmoid": "sigmoid", "flatten": "flatten", "mean": "mean", "amax": "amax", "to": "to",
            "add": "add", "sub": "sub", "mul": "mul", "size": "size"}
#: F.interpolate's keywords the fused forward passes on besides ``size`` (``_function_step`` takes that apart)
_INTERPOLATE = {"scale_factor", "mode", "align_corners"}


def _supported(m: nn.Module) -> bool:
    """Whether the fused forward computes ``m``'s forward (exact types: a subclass may change the forward)."""
    t = type(m)
    if t not in _LEAVES:
        return False
    if t is nn.Conv2d:
        return m.padding_mode == "zeros"
    if t is nn.MaxPool2d:
        return not m.return_indices
    if t is nn.Flatten:
        return m.start_dim == 1 and m.end_dim == -1
    return True


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return type(m) in _LEAVES or super().is_leaf_module(m, qualname)


#: by model, then by its training flag (a forward may branch on it: BiSeNetV2's auxiliary heads)
_PLANS: weakref.WeakKeyDictionary[nn.Module, dict[bool, FusedPlan | None]] = weakref.WeakKeyDictionary()


def _hooked(model: nn.Module) -> bool:
    """Whether a module hook would act in the model's forward or backward (the fused forward calls no module)."""
    from torch.nn.modules import module as mm

    if mm._global_forward_hooks or mm._global_forward_pre_hooks or mm._global_backward_hooks \
            or mm._global_backward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               for m in model.modules())


def fused_plan(model: nn.Module) -> FusedPlan | None:
    """The model's forward as a ``FusedPlan``, or None when it holds a layer or an operation the fused forward does
    not compute (or cannot be traced), or a module hook is registered on it now (a component's mechanism on a
    layer's output, such as ``dct_dp``'s noise, must see the module's call): then it trains under vmap. Traced
    once per model object and training flag (the forward as the model is now: in its mode); the hooks are looked
    at on every call."""
    if _hooked(model):
        return None
    plans = _PLANS.setdefault(model, {})
    if model.training not in plans:
        plans[model.training] = _trace(model)
    return plans[model.training]


def _trace(model: nn.Module) -> FusedPlan | None:
    try:
        graph = _Tracer().trace(model)
    except Exception:  # data-dependent control flow, unusual signatures: vmap handles those
        return None
    steps, names, output = [], {}, None
    kinds: dict[str, str] = {}  # a node's layout if it is not a client's value (CONST, DTYPE)
    for node in graph.nodes:
        if node.op == "placeholder":
            if names:
                return None
            names[node] = "x"
            continue
        if node.op == "output":
            output = node.args[0]
            break
        if node.op == "call_module":
            m = model.get_submodule(node.target)
            if not _supported(m) or len(node.args) != 1 or node.kwargs:
                return None
            step = Step("module", node.name, m, f"{node.target}.", node.args)
        elif node.op == "get_attr":
            step = _constant(model, node)
        elif node.op in ("call_function", "call_method"):
            op = (_FUNCTIONS if node.op == "call_function" else _METHODS).get(node.target)
            step = None if op is None else _function_step(op, node)
        else:
            return None
        if step is None or not all(isinstance(a, fx.Node) and a in names for a in step.args):
            return None
        names[node] = node.name
        step = step._replace(args=tuple(names[a] for a in step.args))
        kind = _kind(step, [kinds.get(a) for a in step.args])
        if kind is False:
            return None
        if kind is not None:
            kinds[node.name] = kind
        steps.append(step)
    outputs = output if isinstance(output, (tuple, list)) and output else (output,)
    if not all(isinstance(o, fx.Node) and o in names and names[o] not in kinds for o in outputs):
        return None
    out = tuple(names[o] for o in outputs) if isinstance(output, (tuple, list)) else names[output]
    return FusedPlan(tuple(_pool_before_relu(steps, out)), out)


def _constant(model: nn.Module, node: fx.Node) -> Step | None:
    """The step reading tensor ``node.target`` of ``model`` when it is outside the model's state: a buffer
    registered as not persistent, or a tensor the tracer found computed from one (``self.mean.to(torch.float64)``,
    kept as an attribute of the model). A parameter or a persistent buffer is each client's own, stacked, which the
    fused forward does not combine with a map: None."""
    owner_name, _, attr = str(node.target).rpartition(".")
    try:
        owner = model.get_submodule(owner_name)
    except AttributeError:
        return None
    if not isinstance(getattr(owner, attr, None), torch.Tensor) or attr in owner._parameters \
            or attr in owner._buffers and attr not in owner._non_persistent_buffers_set:
        return None
    return Step("const", node.name, owner, "", (), attr)


def _kind(step: Step, kinds: list[str | None]) -> str | None | bool:
    """What ``step`` gives from arguments of ``kinds`` (None: a client's value): CONST, DTYPE, None, or False when
    the fused forward does not compute it (a constant where a client's value is needed, a dtype but to cast)."""
    if step.op == "const":
        return CONST
    if step.op == "dtype":
        return DTYPE if kinds[0] != DTYPE else False
    if step.op == "to":
        return kinds[0] if kinds[0] != DTYPE and kinds[1:] in ([], [DTYPE]) else False
    if step.op == "shape":
        return SHAPE if kinds[0] is None else False
    if step.op == "getitem":
        return SHAPE if kinds[0] == SHAPE else False
    if step.op == "interpolate" and kinds[1:]:
        return None if kinds[0] is None and all(k == SHAPE for k in kinds[1:]) else False
    if DTYPE in kinds or SHAPE in kinds:
        return False
    if step.op in _BINARY or step.op == "scale" or step.op in _ELEMENTWISE:
        return CONST if all(k == CONST for k in kinds) else None
    return None if CONST not in kinds else False


def _function_step(op: str, node: fx.Node) -> Step | None:
    """The step of a function or method call ``op`` (``_FUNCTIONS``, ``_METHODS``) with the node's arguments (nodes
    still), or None when its arguments ask for what the fused forward does not compute."""
    args, kw = node.args, dict(node.kwargs)
    if op in _ELEMENTWISE or op in ("add", "sub"):
        if op == "relu":
            kw.pop("inplace", None)
        ok = len(args) == (1 if op in _ELEMENTWISE else 2) and not kw
        return Step(op, node.name, None, "", args) if ok else None
    if op == "getattr":  # a value's dtype or shape
        what = args[1] if len(args) == 2 and not kw else None
        return Step(what, node.name, None, "", args[:1]) if what in ("dtype", "shape") else None
    if op == "size":  # ``x.size()``, ``x.size(d)``: the shape, or its entry d
        d = kw.pop("dim", args[1] if len(args) > 1 else None)
        ok = len(args) <= 2 and not kw and (d is None or _later_dims(d))
        return Step("shape", node.name, None, "", args[:1], d) if ok else None
    if op == "getitem":  # of a shape (``_kind``: of nothing else)
        return Step(op, node.name, None, "", args[:1], args[1]) if len(args) == 2 and _later_dims(args[1]) else None
    if op == "udc":  # RDSN's uniform down-sampling constraint, by a given scale and offset
        try:
            bound = inspect.signature(apply_udc).bind(*args, **kw)
        except TypeError:
            return None
        bound.apply_defaults()
        a = bound.arguments
        ok = type(a["scale"]) is int and type(a["offset"]) is int
        return Step(op, node.name, None, "", (a["out"], a["lr"]), (a["scale"], a["offset"])) if ok else None
    if op == "pad_to":  # rdsn_etc's U-Net: a map zero-padded on the right and bottom to another's size
        return Step(op, node.name, None, "", args) if len(args) == 2 and not kw else None
    if op == "adaptive_avg_pool2d":
        size = kw.pop("output_size", args[1] if len(args) > 1 else None)
        return Step(op, node.name, None, "", args[:1], size) if len(args) <= 2 and not kw and size is not None else None
    if op == "to":  # to a dtype: a node's (``x.dtype``) or a given one
        if len(args) != 2 or kw:
            return None
        if isinstance(args[1], torch.dtype):
            return Step(op, node.name, None, "", args[:1], args[1])
        return Step(op, node.name, None, "", args)
    if op == "mul":
        if len(args) != 2 or kw:
            return None
        factors = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        if len(factors) == 1:  # a node times a number
            return Step("scale", node.name, None, "", tuple(a for a in args if a is not factors[0]), float(factors[0]))
        return Step("mul", node.name, None, "", args)
    if op == "flatten":
        ok = len(args) == 2 and args[1] == 1 and not kw or len(args) == 1 and kw == {"start_dim": 1}
        return Step(op, node.name, None, "", args[:1]) if ok else None
    if op == "cat":  # along the channels only
        dim = kw.pop("dim", args[1] if len(args) > 1 else 0)
        ok = len(args) in (1, 2) and isinstance(args[0], (list, tuple)) and dim == 1 and not kw
        return Step(op, node.name, None, "", tuple(args[0])) if ok else None
    if op in ("mean", "amax"):  # over the channels, kept as one; or over spatial dimensions
        dim = kw.pop("dim", args[1] if len(args) > 1 else None)
        keep = kw.pop("keepdim", args[2] if len(args) > 2 else False)
        if len(args) > 3 or kw or not isinstance(keep, bool):
            return None
        if dim in (1, (1,), [1]):
            return Step(op, node.name, None, "", args[:1]) if keep else None
        dims = (dim,) if isinstance(dim, int) else dim
        spatial = isinstance(dims, (tuple, list)) and dims and all(type(d) is int and d >= 2 for d in dims)
        return Step(op, node.name, None, "", args[:1], (tuple(dims), keep)) if spatial else None
    if op == "interpolate":  # by a scale factor, or to a size (given, or a node's: ``x.shape[-2:]``)
        for name, default in (("size", None), ("scale_factor", None), ("recompute_scale_factor", None),
                              ("antialias", False)):
            if name in kw and kw[name] == default:  # (the tracer records F.interpolate's defaults too)
                del kw[name]
        size = kw.pop("size", None)
        ok = len(args) == 1 and set(kw) <= _INTERPOLATE and (size is None) != ("scale_factor" not in kw)
        if not ok or "scale_factor" in kw and not isinstance(kw["scale_factor"], (int, float)):
            return None
        if isinstance(size, fx.Node):  # (its value is the size)
            return Step(op, node.name, None, "", (args[0], size), kw)
        if isinstance(size, (tuple, list)):  # of numbers and nodes (``(x.shape[2], 8)``): None where a node's
            nodes = tuple(n for n in size if isinstance(n, fx.Node))
            if not all(isinstance(n, fx.Node) or type(n) is int for n in size):
                return None
            return Step(op, node.name, None, "", (args[0], *nodes),
                        {**kw, "size": tuple(None if isinstance(n, fx.Node) else n for n in size)})
        if size is not None and type(size) is not int:
            return None
        return Step(op, node.name, None, "", args, kw if size is None else {**kw, "size": size})
    return None


def _later_dims(index: Any) -> bool:
    """Whether shape entry or slice ``index`` is one the fused forward reads as each client's: it must not name
    the example dimension (0: on a padded step the padded count, not the client's own), by a number other than 0
    or a slice from one. Negative numbers count from the end: the spatial sizes a forward reads to interpolate to;
    only on a value of fewer dimensions than the number would they reach the example dimension."""
    if isinstance(index, slice):
        return isinstance(index.start, int) and index.start != 0 and index.step in (None, 1) \
            and (index.stop is None or isinstance(index.stop, int))
    return type(index) is int and index != 0


def _is_relu(step: Step) -> bool:
    return step.op == "relu" or step.op == "module" and type(step.module) is nn.ReLU


def _pool_before_relu(steps: list[Step], output: str | tuple[str, ...]) -> list[Step]:
    """``steps`` with every ReLU whose only use is a max-pooling swapped with it: max-pooling then ReLU computes
    the same values (ReLU is monotone, so the window's maximum after ReLU is ReLU of its maximum; a padded
    window's -inf stays below any ReLU value) and the same gradients (a positive maximum is the same element;
    a window of no positive value gives every element a zero gradient either way, ReLU's gradient being zero at
    and below 0), on a quarter of the elements for 2x2 pooling: ReLU's forward and backward over the
    convolution's whole output were most of a vectorised small-CNN step's element-wise work."""
    users: dict[str, int] = {o: 1 for o in ((output,) if isinstance(output, str) else output)}
    for step in steps:
        for a in step.args:
            users[a] = users.get(a, 0) + 1
    out = list(steps)
    for i in range(len(out) - 1):
        relu, pool = out[i], out[i + 1]
        if _is_relu(relu) and type(pool.module) is nn.MaxPool2d and pool.args == (relu.name,) and users[relu.name] == 1:
            out[i] = Step("module", relu.name, pool.module, pool.prefix, relu.args)
            out[i + 1] = Step("relu", pool.name, None, "", (relu.name,))
    return out
