"""Style translation by image statistics: FDA's amplitude swap, CFSI's interpolation, LAB's moment matching.

All functions are pure, work on float images ``[C, H, W]`` (or batches ``[B, C, H, W]``) on the 0..255 scale,
keep device and dtype, and leave clipping and the cast back to 8 bits to the caller (``to_uint8``: clip
first, then round; FedDrive's CFSI cast without clipping, so values above 255 wrapped around).

**FDA** (Yang & Soatto 2020; thesis eqs. 5.11-5.15). Per channel, the 2-D DFT of the image to be restyled
is split into amplitude ``A`` and phase ``Phi``; the amplitude's low-frequency window ``M_beta`` (eq. 5.14)
becomes ``lambda * A_style + (1 - lambda) * A_content``; the phase and the high band are kept; the inverse
DFT gives the content in the style's low-frequency appearance (eq. 5.15 with the thesis's note applied:
phase from the image being augmented, amplitude from the style). ``lambda = 1`` is the original FDA swap.
The window is centred on the DC term and symmetric about it, ``2 floor(beta N / 2) + 1`` frequencies along
a side of N, and empty when ``floor(beta N) = 0`` (so ``beta = 0`` changes nothing). Symmetry matters: the
spectrum of a real image is Hermitian, and an asymmetric window (eq. 5.14 read as a plain
``floor(beta N)`` crop of an even-sized spectrum) would change frequencies outside the window when the
result is taken back to real pixels. FDA's code uses the same ``2b + 1`` window; FedDrive's CFSI window of
half-size ``floor(0.05 N)`` is ``beta = 0.1`` here.

**CFSI** (Liu et al. 2021, FedDG): the same with ``lambda ~ U(0, 1)`` per image and the style window drawn
from a bank of *other* clients' windows (``fedsight.recipe``/task code draws; here only the math). A
client shares its images' amplitude *windows* (``amplitude_window``), never whole spectra: a window of a
512 x 1024 image at beta 0.05 is 3 x 25 x 51 floats instead of 3 x 512 x 1024.

**LAB** (Reinhard et al. 2001; thesis eq. 5.16): in CIE-Lab (kornia's conversion from linear RGB in [0, 1]),
every channel is standardised with the image's own mean and std and rescaled to a target's:
``x_hat = (sigma_T / sigma_S) (x - mu_S) + mu_T``. A constant channel (``sigma_S = 0``) is shifted to
``mu_T`` instead of divided by zero (FedDrive's code had no guard).

**Colour jitter** (LADD's ``ColorJitter(brightness=0.5, contrast=0.5, saturation=0.5)``, thesis Sec. 5.3.9):
``adjust_brightness``, ``adjust_contrast`` and ``adjust_saturation`` follow PIL's ``ImageEnhance`` (what
torchvision's PIL path calls): a blend ``degenerate + f (x - degenerate)`` with a black image, the mean grey
level of the image's luma (ITU-R 601: 0.299 R + 0.587 G + 0.114 B) or the luma itself; each result is
clipped and rounded to 8 bits, as PIL works in 8 bits between steps (PIL truncates where this rounds: at most
one level apart per step).
"""

from __future__ import annotations

import torch


def _side(n: int, beta: float) -> slice:
    """The window's range along a side of ``n`` shifted frequencies (DC at ``n // 2``): ``2 floor(beta n / 2)
    + 1`` frequencies symmetric about DC, none when ``floor(beta n) = 0``."""
    if int(beta * n) == 0:
        return slice(n // 2, n // 2)
    b = int(beta * n / 2)
    return slice(n // 2 - b, n // 2 + b + 1)


def _window(h: int, w: int, beta: float, half: int | None = None) -> tuple[slice, slice]:
    """Rows and columns of the low-frequency window of an ``fftshift``-ed ``h x w`` spectrum: from ``beta``,
    or with ``half`` a fixed ``(2 half + 1) x (2 half + 1)`` window (LADD's ``fda_b``: half 1 gives 3 x 3)."""
    if half is not None:
        if half < 0 or 2 * half + 1 > min(h, w):
            raise ValueError(f"a window of half-size {half} does not fit a {h}x{w} spectrum")
        return slice(h // 2 - half, h // 2 + half + 1), slice(w // 2 - half, w // 2 + half + 1)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    return _side(h, beta), _side(w, beta)


def spectrum(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(amplitude, phase) of the centred 2-D DFT over the last two dimensions (eqs. 5.11-5.13)."""
    f = torch.fft.fftshift(torch.fft.fft2(x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)),
                           dim=(-2, -1))
    return f.abs(), f.angle()


def amplitude_window(x: torch.Tensor, beta: float, half: int | None = None) -> torch.Tensor:
    """The low-frequency amplitude window of ``x`` ``[..., C, H, W]`` (``[..., C, 2 floor(beta H / 2) + 1,
    2 floor(beta W / 2) + 1]``, or ``[..., C, 2 half + 1, 2 half + 1]``): an image's style descriptor, what
    CFSI clients share."""
    amp, _ = spectrum(x)
    ys, xs = _window(x.shape[-2], x.shape[-1], beta, half)
    return amp[..., ys, xs].contiguous()


def fda(content: torch.Tensor, style_window: torch.Tensor, beta: float, lam: float = 1.0,
        half: int | None = None) -> torch.Tensor:
    """``content`` ``[..., C, H, W]`` with its low-frequency amplitude window (``beta`` or ``half``) moved to
    ``lam * style_window + (1 - lam) * own window`` (eq. 5.15); phase and high band kept."""
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lambda must be in [0, 1], got {lam}")
    h, w = content.shape[-2:]
    ys, xs = _window(h, w, beta, half)
    if ys.stop == ys.start or xs.stop == xs.start or lam == 0.0:
        return content.clone()
    want = (ys.stop - ys.start, xs.stop - xs.start)
    if tuple(style_window.shape[-2:]) != want:
        size = f"half={half}" if half is not None else f"beta={beta}"
        raise ValueError(f"style window is {tuple(style_window.shape[-2:])}, but {size} on {h}x{w} needs {want}")
    amp, phase = spectrum(content)
    amp = amp.clone()
    amp[..., ys, xs] = lam * style_window.to(amp) + (1.0 - lam) * amp[..., ys, xs]
    f = torch.polar(amp, phase)
    out = torch.fft.ifft2(torch.fft.ifftshift(f, dim=(-2, -1))).real
    return out.to(content.dtype if content.is_floating_point() else torch.float32)


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """Clip to [0, 255], then round to uint8 (never wrap)."""
    return x.clamp(0.0, 255.0).round().to(torch.uint8)


def lab_stats(x: torch.Tensor) -> torch.Tensor:
    """Per-channel (mean, std) of an RGB image ``[3, H, W]`` (0..255) in CIE-Lab: ``[2, 3]`` float64
    (what a LAB client shares per image)."""
    from kornia.color import rgb_to_lab

    lab = rgb_to_lab((x.to(torch.float32) / 255.0).unsqueeze(0))[0].to(torch.float64)
    flat = lab.reshape(3, -1)
    return torch.stack([flat.mean(1), flat.std(1, correction=0)])


def lab_transfer(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """RGB ``[3, H, W]`` (0..255) with its Lab channels moved to the target (mean, std) ``[2, 3]``
    (eq. 5.16); back in RGB on the 0..255 scale (not clipped)."""
    from kornia.color import lab_to_rgb, rgb_to_lab

    lab = rgb_to_lab((x.to(torch.float32) / 255.0).unsqueeze(0))[0].to(torch.float64)
    flat = lab.reshape(3, -1)
    mu, sigma = flat.mean(1, keepdim=True), flat.std(1, correction=0, keepdim=True)
    mu_t, sigma_t = target[0].to(lab).unsqueeze(1), target[1].to(lab).unsqueeze(1)
    scale = torch.where(sigma > 0, sigma_t / sigma.clamp_min(1e-12), torch.zeros_like(sigma))
    out = (flat - mu) * scale + mu_t
    rgb = lab_to_rgb(out.reshape(lab.shape).to(torch.float32).unsqueeze(0), clip=False)[0]
    return rgb * 255.0


def luma(x: torch.Tensor) -> torch.Tensor:
    """ITU-R 601 luma ``[..., 1, H, W]`` of RGB 0..255 ``[..., 3, H, W]`` exactly as PIL's "L" conversion computes
    it (``ImagingConvert``'s fixed point: (19595 R + 38470 G + 7471 B + 2^15) >> 16, the inputs rounded to integers
    first), in ``x``'s dtype. A float 0.299/0.587/0.114 luma rounded half to even differs from it at ties (190.5:
    PIL 191), which a saturation factor near 2 doubles."""
    q = x.round().to(torch.int64)
    fixed = 19595 * q[..., 0:1, :, :] + 38470 * q[..., 1:2, :, :] + 7471 * q[..., 2:3, :, :]
    return ((fixed + 32768) >> 16).to(x.dtype)


def _blend(x: torch.Tensor, degenerate: torch.Tensor, factor: float) -> torch.Tensor:
    return to_uint8(degenerate + factor * (x - degenerate)).to(torch.float32)


def adjust_brightness(x: torch.Tensor, factor: float) -> torch.Tensor:
    """RGB 0..255 scaled by ``factor`` (a blend with black), clipped and rounded."""
    return _blend(x.to(torch.float32), torch.zeros_like(x, dtype=torch.float32), factor)


def adjust_contrast(x: torch.Tensor, factor: float) -> torch.Tensor:
    """RGB 0..255 blended with the constant grey of its mean luma (rounded, as PIL's histogram mean)."""
    x = x.to(torch.float32)
    mean = luma(x).mean(dim=(-3, -2, -1), keepdim=True)
    return _blend(x, torch.floor(mean + 0.5).expand_as(x), factor)


def adjust_saturation(x: torch.Tensor, factor: float) -> torch.Tensor:
    """RGB 0..255 blended with its own luma (0: grey, 1: unchanged)."""
    x = x.to(torch.float32)
    return _blend(x, luma(x).expand_as(x), factor)


def color_jitter(x: torch.Tensor, factors: dict[str, float], order: list[str]) -> torch.Tensor:
    """uint8 RGB ``[3, H, W]`` with the ``factors`` (``brightness``, ``contrast``, ``saturation``) applied in
    ``order`` (torchvision/LADD shuffle the order per image); uint8 out."""
    ops = {"brightness": adjust_brightness, "contrast": adjust_contrast, "saturation": adjust_saturation}
    out = x.to(torch.float32)
    for name in order:
        out = ops[name](out, factors[name])
    return to_uint8(out)
