"""The forward of many clients' models as one ordinary computation, clients folded into the channels.

``fedsight.training.vectorized`` trains the clients of a round together. Its general way is ``torch.func.vmap``
of ``torch.func.grad`` over the model's forward, which works for any model but pays on two counts on a small
convolutional network: functorch's two layers of dispatch on every operation (about 1.3 ms a step for two small
clients on a CPU, where the step itself takes 1 ms), and vmap's layouts, which put the clients first for one
operation and in the channels for the next, so that max-pooling, ReLU's backward and the copies between them
cost several times what they cost one client at a time (``docs/performance.md``).

For a model built only of the layers below, ``fused_trace.fused_plan`` traces the forward once (``torch.fx``) and
``FusedPlan.forward`` runs it for k clients at once with plain PyTorch operations and ordinary autograd:

* a channels-first feature map of the k clients is one tensor (N, k*C, ...), client j's channels at
  [j*C, (j+1)*C) ("fused"; channels-last in memory on a CPU, where the grouped convolution and pooling run
  fastest so); any other value is (k, N, ...) ("stacked");
* ``nn.Conv2d`` is one convolution with k times the groups; pooling, ReLU and ``nn.GroupNorm`` (k times the
  groups) act per channel, hence per client; ``nn.BatchNorm1d/2d`` normalises each client's channels with their
  own batch statistics (the real examples' only on a padded batch; torch's batch norm over the k*C channels where
  no example is padded) and returns each client's new running statistics; ``nn.Linear`` is a batched matrix
  product; ``nn.Dropout`` multiplies by the client's noise drawn beforehand (``vector_batches.draw_noise``), as
  the vmapped forward does;
* element-wise activations (``_ACTIVATIONS``, ``torch.sigmoid``) act on either layout, and so does a product with a
  number;
* a buffer of the model outside its state (``register_buffer(..., persistent=False)``: EDSR's RGB mean) is the
  same for every client: cast (``.to`` a dtype, or the input's ``.dtype``) and added, subtracted or multiplied as
  one client's operand, its channels repeated for each client against a fused map;
* the super-resolution operations (RDSN, EDSR): ``torch.cat(dim=1)`` concatenates within
  each client's channels, a channel mean or max (``keepdim``) reduces within them, a sum or product of a map of
  one channel a client with a wider one broadcasts within each client, ``nn.PixelShuffle``, ``F.interpolate``
  by a scale factor, RDSN's ``apply_udc`` and ``rdsn_etc``'s U-Net padding ``pad_to`` (one operation each for
  torch.fx) act per channel;
* the segmentation operations (DeepLabV3/V3+, BiSeNetV2): ``F.interpolate`` to a size (given, or read off a
  value's shape: ``x.shape[-2:]``, ``x.size(2)``, which is one client's shape), ``F.adaptive_avg_pool2d`` and a
  mean or max over spatial dimensions act per channel; a forward may return a tuple (BiSeNetV2's auxiliary heads
  in training). A shape's example dimension is the padded batch's on a padded step, so it may only be read by an
  index that names a later dimension (``x.shape[0]``, ``x.shape[:2]``: no plan);
* the output comes back stacked, (k, N, ...).

The clients' objectives are summed and differentiated with ``torch.autograd.grad`` with respect to the stacked
weights: no client's loss depends on another's weights, so each client's slice of the gradient is that
client's own gradient, the one ``vmap(grad(...))`` computes (to float rounding). A model with any other layer
or operation, or whose forward cannot be traced, gets no plan and trains under ``vmap``.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..models.cnn import GridPool
from ..models.rdsn import apply_udc
from ..models.rdsn_etc import pad_to

#: parameter-free element-wise layers, as functions (never in place: the input may be a view autograd needs)
_ACTIVATIONS: dict[type, Any] = {
    nn.ReLU: lambda m, t: F.relu(t), nn.ReLU6: lambda m, t: F.relu6(t),
    nn.LeakyReLU: lambda m, t: F.leaky_relu(t, m.negative_slope), nn.ELU: lambda m, t: F.elu(t, m.alpha),
    nn.GELU: lambda m, t: F.gelu(t, approximate=m.approximate), nn.SiLU: lambda m, t: F.silu(t),
    nn.Hardswish: lambda m, t: F.hardswish(t), nn.Hardsigmoid: lambda m, t: F.hardsigmoid(t),
    nn.Sigmoid: lambda m, t: torch.sigmoid(t), nn.Tanh: lambda m, t: torch.tanh(t), nn.Identity: lambda m, t: t,
}
#: element-wise functions and methods of one argument
_ELEMENTWISE = {"relu": F.relu, "sigmoid": torch.sigmoid}
_BINARY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul}
FUSED, STACKED = "fused", "stacked"
#: the layouts of what is not a client's value: a tensor the same for every client, a dtype, and a shape (one
#: client's ``torch.Size``, or part of it)
CONST, DTYPE, SHAPE = "const", "dtype", "shape"


class Step(NamedTuple):
    """One operation of the forward: ``op`` ("module": ``module``'s forward, its state entries under ``prefix``;
    "const": ``module``'s tensor named ``opts``; "dtype": of a value; "to": a value cast to a dtype (the second
    argument's, else ``opts``); "shape": one client's shape of a value (its entry ``opts`` unless None);
    "getitem": entry or slice ``opts`` of a shape; "add", "sub", "mul": of two values; "scale": by the number
    ``opts``; "cat": along the channels; "mean", "amax": over the channels (kept as one) when ``opts`` is None,
    else over the spatial dimensions ``opts[0]`` with keepdim ``opts[1]``; "interpolate": ``F.interpolate`` with
    the keywords ``opts`` (and the size of a second argument); "adaptive_avg_pool2d" to the size ``opts``; "udc":
    ``apply_udc`` of the output and the input with the scale and offset ``opts``; "pad_to": ``pad_to`` of a map
    to another's spatial size;
    "flatten"; or an ``_ELEMENTWISE`` function) on the values of the earlier nodes ``args``, giving node
    ``name``'s."""

    op: str
    name: str
    module: nn.Module | None
    prefix: str
    args: tuple[str, ...]
    opts: Any = None


@dataclass(frozen=True)
class FusedPlan:
    """A model's forward as ``Step`` s."""

    steps: tuple[Step, ...]
    output: str | tuple[str, ...]

    def forward(self, values: dict[str, torch.Tensor], x: torch.Tensor, mask: torch.Tensor | None,
                noise: list[torch.Tensor], updates: dict[str, torch.Tensor]) -> Any:
        """The k clients' outputs (k, N, ...; a tuple of them where the model returns a tuple) on their inputs
        ``x`` (k, N, ...). ``values``: every state entry
        stacked (k, ...); ``mask`` (k, N): each client's real examples (None: all are real); ``noise``: the
        dropout noise of each dropout call in call order, stacked; BatchNorms write the clients' new running
        statistics (stacked, by state key) to ``updates``."""
        k = x.shape[0]
        env: dict[str, tuple[torch.Tensor, str]] = {"x": (x, STACKED)}
        drops = iter(noise)
        for op, name, m, prefix, args, opts in self.steps:
            ins = [env[a] for a in args]  # every argument is an earlier node (``_trace``)
            if op in _BINARY:
                env[name] = _binary(_BINARY[op], *ins[0], *ins[1], k)
            elif op == "const":
                env[name] = (getattr(m, opts), CONST)
            elif op == "dtype":
                env[name] = (ins[0][0].dtype, DTYPE)
            elif op == "shape":  # one client's shape: the same for every client
                t, lay = ins[0]
                shape = t.shape[1:] if lay == STACKED else torch.Size((t.shape[0], t.shape[1] // k, *t.shape[2:]))
                env[name] = (shape if opts is None else shape[opts], SHAPE)
            elif op == "getitem":
                env[name] = (ins[0][0][opts], SHAPE)
            elif op == "to":
                env[name] = (ins[0][0].to(ins[1][0] if len(ins) > 1 else opts), ins[0][1])
            elif op == "scale":
                env[name] = (ins[0][0] * opts, ins[0][1])
            elif op in _ELEMENTWISE:
                env[name] = (_ELEMENTWISE[op](ins[0][0]), ins[0][1])
            elif op == "flatten":
                env[name] = (_layout(*ins[0], STACKED, k).flatten(2), STACKED)
            elif op == "cat":
                env[name] = (_cat_channels([_layout(*i, FUSED, k) for i in ins], k), FUSED)
            elif op in ("mean", "amax") and opts is None:  # over the channels, kept: within each client's
                t = _layout(*ins[0], FUSED, k).unflatten(1, (k, -1))
                env[name] = (t.mean(2) if op == "mean" else t.amax(2), FUSED)
            elif op in ("mean", "amax"):  # over spatial dimensions ``opts[0]`` (per channel: per client)
                t = _layout(*ins[0], FUSED, k)
                env[name] = ((t.mean if op == "mean" else t.amax)(opts[0], keepdim=opts[1]), FUSED)
            elif op == "interpolate":  # (per channel: per client)
                env[name] = (F.interpolate(_layout(*ins[0], FUSED, k), **_sized(opts, [v for v, _ in ins[1:]])), FUSED)
            elif op == "adaptive_avg_pool2d":
                env[name] = (F.adaptive_avg_pool2d(_layout(*ins[0], FUSED, k), opts), FUSED)
            elif op == "udc":  # (per channel: the output's and the input's channels are each client's, in order)
                env[name] = (apply_udc(*(_layout(*i, FUSED, k) for i in ins), *opts), FUSED)
            elif op == "pad_to":  # (spatial: the same sizes for every client)
                env[name] = (pad_to(*(_layout(*i, FUSED, k) for i in ins)), FUSED)
            else:
                env[name] = _module(m, prefix, values, ins[0], k, mask, drops, updates)
        if isinstance(self.output, tuple):
            return tuple(_layout(*env[o], STACKED, k) for o in self.output)
        return _layout(*env[self.output], STACKED, k)

    def arrange(self, stacked: dict[str, torch.Tensor], *, empty: bool = False) -> dict[str, torch.Tensor]:
        """``stacked`` (entries stacked over the clients, by state key) in the memory layout the forward computes
        in: on a CPU each convolution's weights (k, O, I, kh, kw) strided so that their fused view (k*O, I, kh, kw)
        is channels-last, like the feature maps (oneDNN would otherwise copy them into that layout in every
        forward and backward, and the weights' gradients, channels-last, would meet them in the update in another
        layout). The same values (no copy of an entry already so), or with ``empty`` uninitialised tensors of
        the same shapes; anything else as it is."""
        out = dict(stacked)
        for step in self.steps:
            m, prefix = step.module, step.prefix
            w = out.get(prefix + "weight")
            if isinstance(m, nn.Conv2d) and w is not None and w.device.type == "cpu" and w.dim() == 5:
                fused = w.reshape(-1, *w.shape[2:])
                fused = (torch.empty_like(fused, memory_format=torch.channels_last) if empty
                         else fused.contiguous(memory_format=torch.channels_last))
                out[prefix + "weight"] = fused.view(w.shape)
        return out


def _layout(t: torch.Tensor, have: str, want: str, k: int) -> torch.Tensor:
    """``t`` from layout ``have`` to ``want``: (k, N, C, ...) <-> (N, k*C, ...); on a CPU a fused 4-d map is
    channels-last in memory (one copy from stacked)."""
    if have == want:
        return t
    if want == STACKED:
        n, kc = t.shape[:2]
        return t.reshape(n, k, kc // k, *t.shape[2:]).transpose(0, 1)
    kk, n, c = t.shape[:3]
    if t.dim() == 5 and t.device.type == "cpu":
        return t.permute(1, 3, 4, 0, 2).contiguous().view(n, t.shape[3], t.shape[4], kk * c).permute(0, 3, 1, 2)
    return t.transpose(0, 1).reshape(n, kk * c, *t.shape[3:])


def _binary(fn: Any, a: torch.Tensor, la: str, b: torch.Tensor, lb: str, k: int) -> tuple[torch.Tensor, str]:
    """``fn(a, b)`` (add, subtract, multiply) of two values in layouts ``la`` and ``lb``, one of them perhaps a
    constant (``CONST``, the same for every client): each client's ``fn`` of its own operands. Two fused maps of
    different widths broadcast within each client (a map of one channel a client, a spatial gate, against a wider
    one)."""
    if la == CONST and lb == CONST:
        return fn(a, b), CONST
    if CONST in (la, lb):
        t, lay, c = (b, lb, a) if la == CONST else (a, la, b)
        c = c.to(t.device)  # (a tensor the tracer kept as an attribute does not follow the model's moves)
        if lay == FUSED and c.dim() > t.dim():  # the result has more dimensions than the fused map
            t, lay = _layout(t, FUSED, STACKED, k), STACKED
        if lay == STACKED:  # one client's value is t[j]: c broadcasts against it right-aligned, as against t
            t = t.reshape(t.shape[0], *[1] * (c.dim() - t.dim() + 1), *t.shape[1:])
        else:  # fused (N, k*C, ...): c as one client's operand, its channels repeated for each client
            c = c.reshape((1,) * (t.dim() - c.dim()) + tuple(c.shape))
            if c.shape[1] > 1:
                c = c.repeat(1, k, *[1] * (c.dim() - 2))
        return (fn(c, t) if la == CONST else fn(t, c)), lay
    b = _layout(b, lb, la, k)
    if la == STACKED or a.shape[1] == b.shape[1]:
        return fn(a, b), la
    return fn(a.unflatten(1, (k, -1)), b.unflatten(1, (k, -1))).flatten(1, 2), la


def _cat_channels(maps: list[torch.Tensor], k: int) -> torch.Tensor:
    """Fused maps (N, k*C_i, ...) concatenated within each client, ``torch.cat(dim=1)`` of each client's maps:
    (N, k*sum(C_i), ...), client j's channels its own of the first map, then of the second, ... On a CPU a 4-d
    result is channels-last (the fused maps' layout there) without a further copy."""
    if maps[0].dim() == 4 and maps[0].device.type == "cpu":
        parts = [t.permute(0, 2, 3, 1).unflatten(3, (k, -1)) for t in maps]
        return torch.cat(parts, dim=4).flatten(3).permute(0, 3, 1, 2)
    return torch.cat([t.unflatten(1, (k, -1)) for t in maps], dim=2).flatten(1, 2)


def _module(m: nn.Module, prefix: str, values: dict[str, torch.Tensor], arg: tuple[torch.Tensor, str], k: int,
            mask: torch.Tensor | None, drops: Any, updates: dict[str, torch.Tensor]) -> tuple[torch.Tensor, str]:
    t, lay = arg
    get = lambda name: values.get(prefix + name)  # noqa: E731
    if type(m) in _ACTIVATIONS:
        return _ACTIVATIONS[type(m)](m, t), lay
    if isinstance(m, nn.Dropout):
        return (t * _layout(next(drops), STACKED, lay, k) if m.training and m.p > 0 else t), lay
    if isinstance(m, nn.Flatten):  # start_dim 1 (``_supported``): everything but the client and example dims
        return _layout(t, lay, STACKED, k).flatten(2), STACKED
    if isinstance(m, nn.Linear):
        t = _layout(t, lay, STACKED, k)
        w, b = get("weight"), get("bias")
        flat = t.reshape(k, -1, t.shape[-1]).transpose(1, 2)
        # (W x^T)^T rather than x W^T: the weight's gradient (grad_out^T x) then comes out in the weight's own
        # layout, where x W^T gives a transposed one that slows every element-wise op of the update
        out = torch.bmm(w, flat) if b is None else torch.baddbmm(b.unsqueeze(2), w, flat)
        return out.transpose(1, 2).reshape(*t.shape[:-1], out.shape[1]), STACKED
    t = _layout(t, lay, FUSED, k)
    if isinstance(m, nn.PixelShuffle):  # (client j's k*C*r*r channels become its C: per client)
        return F.pixel_shuffle(t, m.upscale_factor), FUSED
    if isinstance(m, nn.Conv2d):
        w, b = get("weight"), get("bias")
        w = w.reshape(-1, *w.shape[2:])
        out = F.conv2d(t, w, None if b is None else b.reshape(-1), m.stride, m.padding, m.dilation, m.groups * k)
    elif isinstance(m, nn.MaxPool2d):
        out = F.max_pool2d(t, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode)
    elif isinstance(m, nn.AvgPool2d):
        out = F.avg_pool2d(t, m.kernel_size, m.stride, m.padding, m.ceil_mode, m.count_include_pad,
                           m.divisor_override)
    elif isinstance(m, GridPool) and tuple(t.shape[-2:]) == m.grid:
        out = t
    elif isinstance(m, nn.AdaptiveAvgPool2d):
        out = F.adaptive_avg_pool2d(t, m.output_size)
    elif isinstance(m, nn.GroupNorm):
        w, b = get("weight"), get("bias")
        out = F.group_norm(t, m.num_groups * k, None if w is None else w.reshape(-1),
                           None if b is None else b.reshape(-1), m.eps)
    elif mask is None and (m.momentum is not None or not m.training):
        out = _torch_batch_norm(m, prefix, values, t, k, updates)
    else:
        out = clients_batch_norm(m, prefix, values, t, k, mask, updates)
    return out, FUSED


def _torch_batch_norm(m: nn.modules.batchnorm._BatchNorm, prefix: str, values: dict[str, torch.Tensor],
                      x: torch.Tensor, k: int, updates: dict[str, torch.Tensor]) -> torch.Tensor:
    """``clients_batch_norm`` where every example is real and the running statistics move by a fixed
    ``momentum``, by torch's own batch norm over the fused map's k*C channels: client j's channels are channels of
    the map, normalised with their statistics over the same examples and positions, and their running statistics
    move as the client's own module moves them. One kernel forward and back, where the general path's strided
    reductions over the clients' view took 2.2 ms a call on DeepLabV3's channels-last maps (a third of a round)."""
    flat = lambda name: None if values.get(prefix + name) is None else values[prefix + name].reshape(-1)  # noqa: E731
    if not (m.training and m.track_running_stats):  # batch statistics without tracking, or the running ones
        use_batch = m.training or m.running_mean is None
        return F.batch_norm(x, None if use_batch else flat("running_mean"), None if use_batch else flat("running_var"),
                            flat("weight"), flat("bias"), use_batch, 0.0, m.eps)
    mean, var = flat("running_mean").clone(), flat("running_var").clone()  # (updated in place: new tensors)
    out = F.batch_norm(x, mean, var, flat("weight"), flat("bias"), True, m.momentum, m.eps)
    updates[prefix + "num_batches_tracked"] = values[prefix + "num_batches_tracked"] + 1
    updates[prefix + "running_mean"], updates[prefix + "running_var"] = mean.view(k, -1), var.view(k, -1)
    return out


def clients_batch_norm(m: nn.modules.batchnorm._BatchNorm, prefix: str, values: dict[str, torch.Tensor],
                       x: torch.Tensor, k: int, mask: torch.Tensor | None,
                       updates: dict[str, torch.Tensor]) -> torch.Tensor:
    """``m``'s forward for k clients at once on a fused map (N, k*C, ...) as pure tensor operations, with each
    client's entries of ``m`` (stacked, by state key) in ``values``: client j's statistics are those of its
    channels over its real examples (``mask`` (k, N); None: all) and positions. Each client's new running
    statistics (what ``nn.BatchNorm``'s forward updates in place: ``num_batches_tracked + 1``, then the running
    mean and the unbiased variance moved by ``momentum``, or by 1 / count when ``momentum`` is None) go to
    ``updates``, stacked. With k = 1 it is one client's BatchNorm (``vectorized._batch_norm``, under vmap)."""
    n_ex, c, sp = x.shape[0], m.num_features, x.shape[2:]
    xv = x.reshape(n_ex, k, c, *sp)
    dims = (0, *range(3, xv.dim()))
    shape = (1, k, c) + (1,) * len(sp)
    if m.training or m.running_mean is None:
        if mask is None:
            mean, var = xv.mean(dims), xv.var(dims, correction=0)
            n: Any = n_ex * math.prod(sp)
        else:
            w = mask.t().reshape((n_ex, k, 1) + (1,) * len(sp))
            n = (mask.sum(1) * math.prod(sp))[:, None]
            mean = (xv * w).sum(dims) / n
            var = ((xv - mean.reshape(shape)).pow(2) * w).sum(dims) / n
        if m.training and m.track_running_stats:
            if isinstance(n, int) and n < 2:
                raise ValueError(f"Expected more than 1 value per channel when training, got input size "
                                 f"{[n_ex, c, *sp]}")
            count = values[prefix + "num_batches_tracked"] + 1
            f = (1.0 / count.to(mean.dtype))[:, None] if m.momentum is None else m.momentum
            updates[prefix + "num_batches_tracked"] = count
            updates[prefix + "running_mean"] = (1 - f) * values[prefix + "running_mean"] + f * mean.detach()
            unbiased = var.detach() * (n / (n - 1))
            updates[prefix + "running_var"] = (1 - f) * values[prefix + "running_var"] + f * unbiased
    else:
        mean, var = values[prefix + "running_mean"], values[prefix + "running_var"]
    y = (xv - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + m.eps)
    if m.weight is not None:
        y = y * values[prefix + "weight"].reshape(shape) + values[prefix + "bias"].reshape(shape)
    return y.reshape(x.shape)


def _sized(opts: dict[str, Any], sizes: list[Any]) -> dict[str, Any]:
    """An "interpolate" step's keywords with its arguments' ``sizes`` (shapes) in place: as the size, or in the
    size's None entries."""
    if not sizes:
        return opts
    template = opts.get("size")
    if template is None:
        return {**opts, "size": sizes[0]}
    given = iter(sizes)
    return {**opts, "size": tuple(next(given) if n is None else n for n in template)}

