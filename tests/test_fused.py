"""The fused forward of vectorised training (``fedsight.training.fused``): which models get a plan, and that the
plan's outputs, BatchNorm statistics and per-client gradients are each client's own, against torch's modules run
one client at a time (the engine-level equality with sequential training is in test_vectorized.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fedsight.models.cnn import CNN, CNNParams
from fedsight.models.rdsn import EDSR, RDSN
from fedsight.training.fused_trace import fused_plan
from helpers import close


class Net(nn.Module):
    """Every layer and operation the fused forward computes, with the awkward settings: a bias-free and a grouped
    convolution, a residual add, ceil-mode max-pooling to an odd size, both BatchNorms."""

    def __init__(self, norm: str, momentum: float | None):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(4, momentum=momentum) if norm == "batch" else nn.GroupNorm(2, 4)
        self.act = nn.LeakyReLU(0.1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, groups=2)
        self.pool = nn.MaxPool2d(2, ceil_mode=True)
        self.avg = nn.AvgPool2d(2, stride=1)
        self.grid = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(16, 6)
        self.bn1 = nn.BatchNorm1d(6, momentum=momentum)
        self.act6 = nn.ReLU6()
        self.gelu = nn.GELU(approximate="tanh")
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = self.act(self.norm(self.conv(x)))
        h = h + self.act6(self.conv2(h))
        h = torch.relu(self.pool(h))
        h = torch.flatten(self.grid(self.avg(h)), 1)
        return self.head(self.gelu(F.relu(self.bn1(self.fc(h)))))


class SRNet(nn.Module):
    """The operations of the super-resolution models (RDSN: dense concatenation, CBAM's spatial gate, sub-pixel
    upsampling, the interpolated global skip; EDSR's scaled residual and mean shift), with the awkward settings: a
    concatenation of three maps of different widths, a one-channel gate both multiplied and added, a number on
    either side of a product, buffers outside the state cast to the input's dtype and to a given one, subtracted
    from the input (stacked) and from a map (fused, a buffer of fewer dimensions on the left), added to the
    output."""

    def __init__(self, scale: int, mode: str):
        super().__init__()
        self.scale, self.mode = scale, mode
        self.a = nn.Conv2d(2, 3, 3, padding=1)
        self.b = nn.Conv2d(5, 2, 1)
        self.fuse = nn.Conv2d(7, 4, 3, padding=1)
        self.gate = nn.Conv2d(2, 1, 3, padding=1)
        self.up = nn.Sequential(nn.Conv2d(4, 2 * scale * scale, 3, padding=1), nn.PixelShuffle(scale))
        self.register_buffer("shift", torch.tensor([0.25, -0.5]).view(1, 2, 1, 1), persistent=False)
        self.register_buffer("level", torch.tensor([0.5, 1.0, -1.0, 2.0]).view(4, 1, 1), persistent=False)

    def forward(self, x):
        shift = self.shift.to(x.dtype)
        x = x - shift
        a = F.relu(self.a(x))
        b = self.b(torch.cat([x, a], dim=1))
        h = self.fuse(torch.cat([a, x, b], dim=1))
        g = torch.sigmoid(self.gate(torch.cat([h.mean(dim=1, keepdim=True), h.amax(dim=1, keepdim=True)], dim=1)))
        h = 0.5 * (h * g) + g + (self.level.to(torch.float64) - h) * 2
        corners = None if self.mode == "nearest" else False
        return self.up(h) + F.interpolate(x, scale_factor=self.scale, mode=self.mode, align_corners=corners) + shift


class SegNet(nn.Module):
    """The operations of the segmentation models (DeepLab's ASPP image pooling, BiSeNetV2's context embedding and
    auxiliary heads), with the awkward settings: BatchNorm of pooled 1x1 maps, sizes read off the input (stacked)
    and off a map (fused) by ``.shape`` and ``.size`` (a size built of both, of a map that is not square), a size
    of a number and a node, spatial reductions kept and not kept, three outputs in training and one in eval."""

    def __init__(self, norm: str, momentum: float | None):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.norm = nn.BatchNorm2d(4, momentum=momentum) if norm == "batch" else nn.GroupNorm(2, 4)
        self.pool_conv = nn.Conv2d(4, 4, 1)
        self.pool_norm = nn.BatchNorm2d(4, momentum=momentum)
        self.head = nn.Conv2d(8, 3, 1)
        self.aux = nn.Conv2d(4, 3, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = F.relu(self.norm(self.conv(x)))
        h = h + h.mean((2, 3), keepdim=True)
        p = F.relu(self.pool_norm(self.pool_conv(F.adaptive_avg_pool2d(h, 1))))
        p = F.interpolate(p, size=h.shape[-2:], mode="bilinear", align_corners=False)
        out = F.interpolate(self.head(torch.cat([h, p], dim=1)), size=(x.size(2), x.shape[-1]), mode="bilinear")
        out = out * torch.sigmoid(h.amax(dim=(2, 3), keepdim=True).mean(dim=1, keepdim=True))
        if not self.training:
            return out
        return out, F.interpolate(self.aux(h), size=(7, h.shape[-1]), mode="nearest"), self.fc(h.mean((2, 3)))


class Resize(nn.Module):
    def forward(self, x):
        return F.interpolate(x, size=x.shape[:2])  # the example dimension's size: on a padded step not a client's


class ShapeTimes(nn.Module):
    def forward(self, x):
        return x * x.shape[-1]  # a shape where a client's value is needed


class CatExamples(nn.Module):
    def forward(self, x):
        return torch.cat([x, x], dim=0)  # along the examples, not the channels


class MeanDropped(nn.Module):
    def forward(self, x):
        return x - x.mean(dim=1).unsqueeze(1)  # the channel dimension not kept


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else -self.fc(x)  # data-dependent: cannot be traced


class Held(nn.Module):
    """A tensor held by the model used as it is: a parameter or a persistent buffer (a client's own, stacked) in a
    product, or a buffer outside the state fed to a convolution (a constant where a client's map is needed)."""

    def __init__(self, what: str):
        super().__init__()
        self.what, self.conv = what, nn.Conv2d(1, 1, 1)
        if what == "parameter":
            self.t = nn.Parameter(torch.ones(1, 1, 1))
        else:
            self.register_buffer("t", torch.ones(1, 1, 2, 2), persistent=what == "persistent")

    def forward(self, x):
        return self.conv(self.t) + x if self.what == "into a conv" else self.conv(x) * self.t


class MyConv(nn.Conv2d):
    def forward(self, x):
        return super().forward(x) * 2


@pytest.mark.parametrize("model, planned", [
    (CNN(CNNParams(norm="batch"), num_classes=3, in_channels=1, image_size=8), True),
    (CNN(CNNParams(norm="group", dropout=0.5), num_classes=3, in_channels=1, image_size=8), True),
    (Net("batch", 0.1), True),
    (nn.Sequential(nn.Conv2d(1, 2, 3), nn.Softplus(), nn.Flatten(), nn.Linear(2, 2)), False),  # not in the list
    (nn.Sequential(nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect"), nn.Flatten(), nn.Linear(18, 2)), False),
    (nn.Sequential(MyConv(1, 2, 3), nn.Flatten(), nn.Linear(2, 2)), False),  # a subclass may change the forward
    (nn.Sequential(nn.Conv2d(1, 2, 3), nn.Upsample(scale_factor=2)), False),
    (nn.Sequential(nn.Linear(4, 4), nn.Flatten(2)), False),
    (Branchy(), False),
    (SRNet(2, "bicubic"), True),
    (RDSN(2, features=8, blocks=2, layers=2, growth=4), True),
    (RDSN(2, features=8, blocks=1, layers=2, growth=4, udc=True), True),  # the UDC: one traced operation
    (EDSR(2, features=8, blocks=1, mean_shift=False), True),
    (EDSR(2, features=8, blocks=1), True),  # the mean shift: a buffer outside the state, cast to the input's dtype
    (Held("parameter"), False),
    (Held("persistent"), False),
    (Held("into a conv"), False),
    (Held("non-persistent"), True),
    (SegNet("batch", 0.1), True),
    (SegNet("group", None).eval(), True),
    (Resize(), False),
    (ShapeTimes(), False),
    (CatExamples(), False),
    (MeanDropped(), False),
])
def test_which_models_get_a_plan(model, planned):
    assert (fused_plan(model) is not None) is planned


@settings(max_examples=40, deadline=None)
@given(make=st.sampled_from([Net, SegNet]), norm=st.sampled_from(["batch", "group"]),
       momentum=st.sampled_from([None, 0.3]), training=st.booleans(),
       real=st.lists(st.integers(2, 4), min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_fused_forward_is_each_clients_forward(make, norm, momentum, training, real, seed):
    """k clients with their own weights and running statistics, each with ``real[j]`` real examples in a batch
    padded to 4: outputs on the real examples, new running statistics and the gradient of each client's mean
    squared output (summed over the outputs of a tuple), against the client's own ``nn`` model on its unpadded
    batch (``torch.autograd``)."""
    gen = torch.Generator().manual_seed(seed)
    k, n = len(real), 4
    models = []
    for _ in real:
        m = make(norm, momentum).double().train(training)
        with torch.no_grad():
            for t in m.state_dict(keep_vars=True).values():
                if t.is_floating_point():
                    t.copy_(torch.rand(t.shape, generator=gen, dtype=t.dtype) + 0.5)
                else:
                    t.fill_(int(torch.randint(0, 3, (), generator=gen)))
        models.append(m)
    plan = fused_plan(models[0])
    x = torch.randn(k, n, 2, 5, 8, generator=gen, dtype=torch.float64)
    mask = (torch.arange(n) < torch.tensor(real)[:, None]).double()
    padded = mask.bool().all()
    params = {name: torch.stack([dict(m.named_parameters())[name].detach() for m in models]).requires_grad_()
              for name, _ in models[0].named_parameters()}
    values = {**{name: torch.stack([m.state_dict()[name] for m in models]) for name in models[0].state_dict()},
              **params}
    updates: dict[str, torch.Tensor] = {}
    outs = plan.forward(values, x, None if padded else mask, [], updates)
    outs = outs if isinstance(outs, tuple) else (outs,)
    assert [o.shape[:2] for o in outs] == [(k, n)] * (3 if make is SegNet and training else 1)
    losses = sum((o.pow(2).flatten(2).mean(-1) * mask).sum(1) / mask.sum(1) for o in outs)
    grads = dict(zip(params, _grads(losses.sum(), list(params.values()))))
    for j, m in enumerate(models):
        refs = m(x[j, : real[j]])
        refs = refs if isinstance(refs, tuple) else (refs,)
        for o, ref in zip(outs, refs, strict=True):
            close(o[j, : real[j]], ref, atol=1e-9, rtol=1e-9)
        ref_grads = _grads(sum(r.pow(2).mean() for r in refs), list(m.parameters()))
        for (name, _), g in zip(m.named_parameters(), ref_grads):
            close(grads[name][j], g, atol=1e-9, rtol=1e-9)
        for name, v in m.state_dict().items():  # the module's own update, in place
            if name in updates:
                close(updates[name][j].to(v.dtype), v, atol=1e-12, rtol=1e-9)
    assert bool(updates) == training  # bn1 is a BatchNorm whatever the norm


@settings(max_examples=20, deadline=None)
@given(k=st.integers(1, 3), scale=st.sampled_from([2, 3]), mode=st.sampled_from(["nearest", "bilinear", "bicubic"]),
       seed=st.integers(0, 2**16))
def test_fused_super_resolution_forward_is_each_clients_forward(k, scale, mode, seed):
    """The operations of the SR models (``SRNet``) for k clients with their own weights: outputs and each client's
    gradient against its own module (float64)."""
    gen = torch.Generator().manual_seed(seed)
    out = _each_clients_own(lambda: SRNet(scale, mode), torch.randn(k, 2, 2, 5, 4, generator=gen, dtype=torch.float64),
                            gen)
    assert out.shape == (k, 2, 2, 5 * scale, 4 * scale)


def _grads(loss: torch.Tensor, wrt: list[torch.Tensor]) -> list[torch.Tensor]:
    """d loss / d wrt, zeros for what the loss does not use (SegNet's auxiliary heads in eval)."""
    got = torch.autograd.grad(loss, wrt, allow_unused=True)
    return [torch.zeros_like(w) if g is None else g for w, g in zip(wrt, got)]


def _each_clients_own(make, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The fused forward of ``len(x)`` models ``make()`` with their own random weights (float64) on inputs ``x``
    (clients, examples, ...): the outputs and each client's gradient checked against its own module. The output."""
    models = []
    for _ in range(len(x)):
        m = make().double()
        with torch.no_grad():
            for t in m.parameters():
                t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype))
        models.append(m)
    plan = fused_plan(models[0])
    params = {name: torch.stack([dict(m.named_parameters())[name].detach() for m in models]).requires_grad_()
              for name, _ in models[0].named_parameters()}
    out = plan.forward(dict(params), x, None, [], {})
    grads = dict(zip(params, torch.autograd.grad(out.pow(2).sum(), list(params.values()))))
    for j, m in enumerate(models):  # (to float64 rounding of the largest value: a gradient sums values of ~1e6)
        ref = m(x[j])
        close(out[j], ref, atol=1e-12 * float(ref.detach().abs().max()), rtol=1e-9)
        for (name, _), g in zip(m.named_parameters(), torch.autograd.grad(ref.pow(2).sum(), list(m.parameters()))):
            close(grads[name][j], g, atol=1e-12 * float(g.detach().abs().max()), rtol=1e-9)
    return out


@pytest.mark.parametrize("scale, offset", [(2, 0), (3, 1), (3, 2)])
def test_the_uniform_down_sampling_constraint_is_each_clients(scale, offset):
    """RDSN with its UDC (PPFL-RDSN's model: the output's pixels at (o + s i, o + s j) are the input's) for three
    clients: outputs and gradients against each client's own module, and the kept pixels exactly the input's."""
    gen = torch.Generator().manual_seed(scale + offset)
    x = torch.rand(3, 2, 3, 5, 4, generator=gen, dtype=torch.float64)
    out = _each_clients_own(lambda: RDSN(scale, features=8, blocks=1, layers=2, growth=4, udc=True, udc_offset=offset),
                            x, gen)
    assert torch.equal(out[..., offset::scale, offset::scale], x)


class Wider(nn.Module):
    """Buffers outside the state with more dimensions than a client's map: the result grows a dimension, from a
    fused map and from a stacked (flattened) one."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(2, 3, 3, padding=1), nn.Linear(72, 2)
        self.register_buffer("five", torch.tensor([1.0, -2.0]).view(2, 1, 1, 1, 1), persistent=False)
        self.register_buffer("three", torch.tensor([0.5, 3.0, 1.0]).view(3, 1, 1), persistent=False)

    def forward(self, x):
        h = self.conv(x) * self.five  # (2, N, 3, H, W)
        return self.three - self.fc(torch.flatten(h, 1))  # (3, 2, 2)


def test_constants_that_add_dimensions_are_each_clients_operands():
    gen = torch.Generator().manual_seed(0)
    out = _each_clients_own(Wider, torch.randn(3, 4, 2, 2, 3, generator=gen, dtype=torch.float64), gen)
    assert out.shape == (3, 3, 2, 2)


def test_a_models_plan_is_its_forward_in_its_current_mode():
    """A forward that branches on ``self.training`` (SegNet: three outputs in training, one in eval) gets the plan
    of the mode it is in, whichever mode it was first traced in."""
    m = SegNet("batch", 0.1).eval()
    assert isinstance(fused_plan(m).output, str)
    assert len(fused_plan(m.train()).output) == 3
    assert isinstance(fused_plan(m.eval()).output, str)


def test_a_module_hook_sends_the_model_back_to_vmap():
    """A hook on a layer (``dct_dp`` noises a layer's output with one) must see the module's call, which the fused
    forward does not make: while one is registered the model gets no plan."""
    model = CNN(CNNParams(), num_classes=3, in_channels=1, image_size=8)
    assert fused_plan(model) is not None
    for register in (lambda m: m.register_forward_hook(lambda *a: None),
                     lambda m: m.register_forward_pre_hook(lambda *a: None),
                     lambda m: m.register_full_backward_hook(lambda *a: None)):
        handle = register(model.backbone[0])
        assert fused_plan(model) is None
        handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert fused_plan(model) is None
    finally:
        handle.remove()
    assert fused_plan(model) is not None


class PoolAfterRelu(nn.Module):
    """ReLU before max-pooling in every form the plan swaps (module, function, method; 2x2, and 3x3 with stride 2
    and padding), and three it must not: a ReLU whose output has two uses, a ReLU before another ReLU, and one
    before average pooling."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.act = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(3, 3, 3, padding=1)
        self.pool3 = nn.MaxPool2d(3, stride=2, padding=1)
        self.avg = nn.AvgPool2d(3, divisor_override=1)  # a sum: exact on integers
        self.fc = nn.Linear(3, 2)

    def forward(self, x):  # x: 6x6
        h = self.pool(self.act(self.conv(x)))  # 3x3
        r = F.relu(self.conv2(h))
        h = self.pool3(r) + self.pool3(r)  # 2x2
        h = self.pool(torch.relu(self.conv2(h)).relu())  # 1x1
        g = self.avg(F.relu(self.conv2(self.pool3(self.act(self.conv(x))))))  # 1x1
        return self.fc(torch.flatten(h + g, 1))


def test_relu_then_max_pool_computes_as_pool_then_relu_with_the_same_values_and_gradients():
    """The plan runs max-pooling before a ReLU whose only use it is (a quarter of the elements for ReLU's forward
    and backward). Integer weights and inputs with many zeros, negatives and ties make every product and sum
    exact in float64, so each client's outputs and gradients must equal its own module's bit for bit: a swap
    that changed which element of a window gets the gradient, or one made where it is wrong (a ReLU before
    average pooling or with two uses), shows."""
    model = PoolAfterRelu()
    plan = fused_plan(model)
    assert plan is not None
    ops = [s.module.__class__.__name__ if s.op == "module" else s.op for s in plan.steps]
    assert ops == ["Conv2d", "MaxPool2d", "relu",  # swapped
                   "Conv2d", "relu", "MaxPool2d", "MaxPool2d", "add",  # two uses
                   "Conv2d", "relu", "MaxPool2d", "relu",  # the second ReLU swapped
                   "Conv2d", "MaxPool2d", "relu",  # swapped
                   "Conv2d", "relu", "AvgPool2d", "add", "flatten", "Linear"]
    gen = torch.Generator().manual_seed(0)
    k, n = 3, 4
    models = []
    for _ in range(k):
        m = PoolAfterRelu().double()
        with torch.no_grad():
            for t in m.parameters():
                t.copy_(torch.randint(-2, 3, t.shape, generator=gen))
        models.append(m)
    x = torch.randint(-2, 3, (k, n, 2, 6, 6), generator=gen).double()
    params = {name: torch.stack([dict(m.named_parameters())[name].detach() for m in models]).requires_grad_()
              for name, _ in model.named_parameters()}
    out = plan.forward(dict(params), x, None, [], {})
    grads = dict(zip(params, torch.autograd.grad(out.pow(2).sum(), list(params.values()))))
    nonzero = 0
    for j, m in enumerate(models):
        ref = m(x[j])
        assert torch.equal(out[j], ref)
        for (name, _), g in zip(m.named_parameters(), torch.autograd.grad(ref.pow(2).sum(), list(m.parameters()))):
            assert torch.equal(grads[name][j], g), name
            nonzero += int(g.count_nonzero())
    assert nonzero > 0
