"""Style translation math (fedsight.functional.style) against numpy's FFT and scikit-image's Lab conversion."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from skimage.color import rgb2lab

from fedsight.functional.style import amplitude_window, fda, lab_stats, lab_transfer, to_uint8


def image(seed, h=16, w=24):
    return torch.from_numpy(np.random.default_rng(seed).uniform(0, 255, (3, h, w)))


@given(st.integers(0, 1000), st.sampled_from([(16, 24), (15, 21), (8, 8)]))
def test_beta_zero_or_lambda_zero_is_the_identity(seed, hw):
    x, s = image(seed, *hw), image(seed + 1, *hw)
    assert torch.equal(fda(x, amplitude_window(s, 0.0), 0.0), x)
    assert torch.equal(fda(x, amplitude_window(s, 0.2), 0.2, lam=0.0), x)


@given(st.integers(0, 1000), st.sampled_from([0.1, 0.25, 0.5]), st.floats(0.1, 1.0))
def test_fda_keeps_the_phase_and_mixes_only_the_window(seed, beta, lam):
    x, s = image(seed), image(seed + 7)
    out = fda(x, amplitude_window(s, beta), beta, lam).numpy()
    f_in = np.fft.fftshift(np.fft.fft2(x.numpy()), axes=(-2, -1))
    f_st = np.fft.fftshift(np.fft.fft2(s.numpy()), axes=(-2, -1))
    f_out = np.fft.fftshift(np.fft.fft2(out), axes=(-2, -1))
    h, w = x.shape[-2:]
    # the window: frequencies -b..b around DC (index n // 2 after the shift), b = floor(beta n / 2)
    inside = np.zeros((h, w), dtype=bool)
    bh, bw = int(beta * h / 2), int(beta * w / 2)
    inside[h // 2 - bh : h // 2 + bh + 1, w // 2 - bw : w // 2 + bw + 1] = True
    want = np.abs(f_in).copy()
    want[:, inside] = lam * np.abs(f_st)[:, inside] + (1 - lam) * np.abs(f_in)[:, inside]
    np.testing.assert_allclose(np.abs(f_out), want, rtol=1e-6, atol=1e-5)
    keep = np.abs(f_in) > 1e-6
    np.testing.assert_allclose(np.cos(np.angle(f_out) - np.angle(f_in))[keep], 1.0, atol=1e-6)


def test_to_uint8_clips_instead_of_wrapping():
    assert to_uint8(torch.tensor([-3.0, 0.4, 254.6, 300.0])).tolist() == [0, 0, 255, 255]


def test_lab_transfer_matches_the_target_statistics():
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.uniform(60, 200, (3, 12, 14)))  # inside the gamut after the shift below
    target = lab_stats(torch.from_numpy(rng.uniform(40, 220, (3, 12, 14))))
    out = lab_transfer(x, target)
    got = lab_stats(out)
    torch.testing.assert_close(got, target, rtol=0, atol=2e-3)
    # the statistics are scikit-image's Lab: an independent conversion of the same image
    lab = rgb2lab(x.permute(1, 2, 0).numpy() / 255.0).reshape(-1, 3)
    np.testing.assert_allclose(lab_stats(x)[0].numpy(), lab.mean(0), atol=2e-2)
    np.testing.assert_allclose(lab_stats(x)[1].numpy(), lab.std(0), atol=2e-2)


def test_lab_transfer_of_a_constant_channel_does_not_divide_by_zero():
    x = torch.full((3, 4, 4), 128.0)
    target = torch.tensor([[60.0, 5.0, -5.0], [10.0, 3.0, 3.0]], dtype=torch.float64)
    out = lab_transfer(x, target)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(lab_stats(out)[0], target[0], rtol=0, atol=2e-3)


def test_window_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="style window"):
        fda(image(0), amplitude_window(image(1, 32, 32), 0.25), 0.25)
    assert amplitude_window(image(1, 16, 24), 0.1).shape == (3, 1, 3)  # 2 floor(0.8) + 1, 2 floor(1.2) + 1


def test_a_fixed_half_size_window_is_centred_on_dc_and_fda_uses_it():
    """LADD's style window: (2 half + 1)^2 frequencies around DC whatever the image size (half 1: 3 x 3, a
    27-number style for 3 channels); the DC amplitude is the channel's pixel sum."""
    torch.manual_seed(0)
    x = torch.rand(3, 20, 34) * 255
    win = amplitude_window(x, 0.0, half=1)
    assert win.shape == (3, 3, 3)
    assert torch.allclose(win[:, 1, 1], x.sum((-2, -1)), rtol=1e-5)
    full = torch.fft.fftshift(torch.fft.fft2(x), dim=(-2, -1)).abs()
    assert torch.allclose(win, full[:, 9:12, 16:19])
    style = amplitude_window(torch.rand(3, 20, 34) * 255, 0.0, half=1)
    out = fda(x, style, 0.0, 1.0, half=1)
    assert torch.allclose(amplitude_window(out, 0.0, half=1), style, rtol=1e-4, atol=1e-2)
    with pytest.raises(ValueError, match="half-size 12 does not fit a 20x34"):
        amplitude_window(x, 0.0, half=12)
