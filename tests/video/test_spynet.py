"""SPyNet (BasicSR/KAIR layout) and its flow_warp."""

from __future__ import annotations

import pytest
import torch

from fedsight.models.spynet import SpyNet, drop_constants, flow_warp


def published_spynet_shapes() -> dict[str, tuple[int, ...]]:
    """Key -> shape of BasicSR's ``spynet_sintel_final`` checkpoint, written from its architecture
    (basicsr/archs/spynet_arch.py: six BasicModules, each Sequential(conv7 8->32, ReLU, 32->64, ReLU, 64->32, ReLU,
    32->16, ReLU, 16->2)), independently of FedSight's module."""
    out = {}
    for level in range(6):
        for idx, (cin, cout) in zip((0, 2, 4, 6, 8), ((8, 32), (32, 64), (64, 32), (32, 16), (16, 2))):
            out[f"basic_module.{level}.basic_module.{idx}.weight"] = (cout, cin, 7, 7)
            out[f"basic_module.{level}.basic_module.{idx}.bias"] = (cout,)
    return out


def test_state_dict_has_the_published_keys_and_shapes():
    net = SpyNet()
    assert {k: tuple(v.shape) for k, v in net.state_dict().items()} == published_spynet_shapes()
    assert sum(p.numel() for p in net.parameters()) == 1_440_300  # 6 x 240,050


def test_a_published_state_loads_every_value_in_its_place():
    shapes = published_spynet_shapes()
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    net = SpyNet()
    net.load_state_dict(state, strict=True)
    for k, v in net.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_flow_warp_shifts_by_whole_pixels_with_zeros_outside():
    x = torch.arange(20.0).view(1, 1, 4, 5)
    flow = torch.zeros(1, 4, 5, 2)
    flow[..., 0] = 1.0  # sample one pixel to the right
    out = flow_warp(x, flow)
    assert torch.allclose(out[..., :4], x[..., 1:], atol=1e-5)
    assert torch.allclose(out[..., 4], torch.zeros(1, 1, 4))
    flow = torch.zeros(1, 4, 5, 2)
    flow[..., 1] = -1.0  # one pixel up
    out = flow_warp(x, flow, padding_mode="border")
    assert torch.allclose(out[..., 1:, :], x[..., :3, :], atol=1e-5)
    assert torch.allclose(out[..., 0, :], x[..., 0, :], atol=1e-5)
    with pytest.raises(ValueError, match="does not fit"):
        flow_warp(x, torch.zeros(1, 2, 4, 5))


def test_untrained_identity_init_gives_zero_flow_and_any_size_works():
    net = SpyNet()
    ref, supp = torch.rand(2, 3, 20, 27), torch.rand(2, 3, 20, 27)
    flow = net(ref, supp)
    assert flow.shape == (2, 2, 20, 27)
    assert torch.equal(flow, torch.zeros_like(flow))


def test_flow_is_scaled_back_to_the_input_size():
    """A constant flow at the 32-multiple size comes back scaled by W/W' and H/H' (BasicSR's last step)."""
    net = SpyNet()
    with torch.no_grad():
        net.basic_module[5].basic_module[8].bias.copy_(torch.tensor([2.0, 3.0]))
    flow = net(torch.rand(1, 3, 40, 50), torch.rand(1, 3, 40, 50))  # resized to 64 x 64
    assert torch.allclose(flow[:, 0], torch.full((1, 40, 50), 2.0 * 50 / 64), atol=1e-5)
    assert torch.allclose(flow[:, 1], torch.full((1, 40, 50), 3.0 * 40 / 64), atol=1e-5)


def test_coarse_flow_is_upsampled_and_doubled_level_by_level():
    """A constant flow c from level 0 reaches level 5 as 2**5 c (x2 per level, bilinear with align_corners=True
    keeps a constant); on a 64x64 frame no rescaling follows."""
    net = SpyNet()
    with torch.no_grad():
        net.basic_module[0].basic_module[8].bias.copy_(torch.tensor([0.25, -0.5]))
    flows = net.pyramid(torch.rand(1, 3, 64, 64), torch.rand(1, 3, 64, 64), levels=(5, 3, 0))
    assert [tuple(f.shape[-2:]) for f in flows] == [(64, 64), (16, 16), (2, 2)]
    for f, lvl in zip(flows, (5, 3, 0)):
        assert torch.allclose(f[:, 0], torch.full_like(f[:, 0], 0.25 * 2 ** lvl), atol=1e-5)
        assert torch.allclose(f[:, 1], torch.full_like(f[:, 1], -0.5 * 2 ** lvl), atol=1e-5)


def test_normalisation_uses_imagenet_constants():
    """With the first level's first conv reading only the ref's red channel, level 0 sees (x - 0.485) / 0.229."""
    net = SpyNet()
    assert "mean" not in net.state_dict() and "std" not in net.state_dict()
    with torch.no_grad():
        m = net.basic_module[0].basic_module
        for layer in m:
            if isinstance(layer, torch.nn.Conv2d):
                layer.weight.zero_()
                layer.bias.zero_()
        m[0].weight[0, 0, 3, 3] = 1.0  # channel 0 of conv1 = ref red, centre tap
        m[2].weight[0, 0, 3, 3] = 1.0
        m[4].weight[0, 0, 3, 3] = 1.0
        m[6].weight[0, 0, 3, 3] = 1.0
        m[8].weight[0, 0, 3, 3] = 1.0  # x flow = relu chain of the normalised red value
    ref = torch.full((1, 3, 64, 64), 0.9)
    (flow,) = net.pyramid(ref, torch.rand(1, 3, 64, 64), levels=(0,))
    assert torch.allclose(flow[:, 0], torch.full_like(flow[:, 0], (0.9 - 0.485) / 0.229), atol=1e-5)


def test_drop_constants_checks_the_values():
    state = {"spynet.mean": torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1),
             "spynet.std": torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1), "spynet.x": torch.zeros(1)}
    assert set(drop_constants(state)) == {"spynet.x"}
    state["spynet.std"] = torch.ones(1, 3, 1, 1)
    with pytest.raises(ValueError, match="spynet.std"):
        drop_constants(state)


def test_rejects_frames_of_different_shapes():
    with pytest.raises(ValueError, match="SpyNet expects"):
        SpyNet()(torch.rand(1, 3, 8, 8), torch.rand(1, 3, 8, 9))


def test_a_smaller_spynet_and_bad_arguments():
    net = SpyNet(hidden=(4, 4, 4, 4))
    assert net.basic_module[0].basic_module[2].weight.shape == (4, 4, 7, 7)
    assert net(torch.rand(1, 3, 9, 9), torch.rand(1, 3, 9, 9)).shape == (1, 2, 9, 9)
    with pytest.raises(ValueError, match="four positive numbers"):
        SpyNet(hidden=(4, 4, 4))
    with pytest.raises(ValueError, match=r"levels must be in 0..5"):
        net.pyramid(torch.rand(1, 3, 9, 9), torch.rand(1, 3, 9, 9), levels=(6,))
