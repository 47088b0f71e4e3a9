"""Encryption-then-lossy-compression (EtLC) of images, as in PPFL-RDSN's evaluation pipeline.

The pipeline (PPFL-RDSN, He & Joshi, builds on Wang et al. [20], IEEE TMM 2023; see
``shared/seeds/notes/001_ppfl_rdsn.md`` sections 1.2 and 2.5):

1. The **sender encrypts** the image by adding a keyed pseudo-random byte stream, modulo 256
   (:func:`encrypt`): ``c = (x + k) mod 256``, per pixel and channel.
2. **Anyone** (a channel or a cloud, without the key) **compresses** the ciphertext lossily by uniform
   down-sampling with factor ``s``: it keeps every ``s``-th pixel in both directions, starting at
   ``offset`` (:func:`compress`: ``c[o::s, o::s]``). The compression ratio is ``1 / s**2``.
3. The **receiver decrypts** the kept pixels with the same sub-sampling of the key stream
   (:func:`decrypt_subsampled`). The result equals sub-sampling the plaintext, bit for bit.
4. The receiver **reconstructs** a full-size image with a super-resolution model under the uniform
   down-sampling constraint, UDC (:func:`reconstruct`, :func:`write_back`): it writes the kept pixels back
   exactly at ``(o + y s, o + x s)`` over the SR output. This is the UDC of ETC-RDSN's ``sr_insert.py``,
   which uses Python loops; here it is one strided slice assignment.

Conventions: images are numpy ``uint8`` arrays ``[H, W, C]`` (channels last, as PIL and PNG store them) or
``[H, W]``. The key stream has the image's full shape. Down-sampling acts on the first two axes. The
torch side (:func:`write_back`, :func:`reconstruct`'s model) uses ``[..., C, H, W]``, as the SR models do.

The cipher: the paper does not specify one. Its evaluation "applies the encryption-then-lossy-compression
pipeline" and leaves key sharing "out of scope". Wang et al. [20] give modulo-256 addition of a
pseudo-random stream but not the generator. **Our key stream is SHAKE-256**
(:func:`keystream`, FIPS 202), which is a choice of ours. We read SHAKE-256 as an extendable-output
function over a domain-separated, length-prefixed header ``(domain, key, nonce, shape)``. One ``digest``
call gives the whole stream, so it is deterministic and vectorised. Adding a stream modulo 256 makes a
stream cipher (a one-time pad over ``Z_256``, with a computational stream in place of a truly random one).

What the scheme protects, and what it does not:

* **Protected: confidentiality of pixel values.** This holds while the key is secret and
  ``(key, nonce)`` is never used for two images. Without the key, every ciphertext byte is uniform on
  0..255 whatever the pixel, so the ciphertext's histogram is flat (the tests check this with a
  chi-square test). The down-sampled ciphertext is the same kind of pad over the kept pixels.
* **Not protected: the image's size.** The ciphertext has the plaintext's shape (H, W, channels), and the
  sidecar metadata states the scale and offset in clear. Size, aspect ratio and compression factor leak.
* **Not protected: integrity and authenticity.** There is no MAC, and the cipher is malleable: adding
  ``d`` to a ciphertext byte adds ``d`` (mod 256) to the decrypted pixel, with no way to notice. An
  attacker can also swap, crop or shift regions. Use an authenticated channel, or a MAC over the
  ciphertext, if this matters. :func:`key_check` only catches using the wrong key by accident; it is
  not authentication.
* **Key or nonce reuse is fatal (the two-time pad).** Two images encrypted under the same
  ``(key, nonce)`` satisfy ``c1 - c2 = x1 - x2 (mod 256)``. That leaks the difference image, whose
  structure reveals both images. Use a fresh random nonce per image (the CLI draws 16 random bytes).
  The nonce is not secret. The stream also depends on the image shape, but that is not a substitute
  for a fresh nonce.
* **Key management** (how sender and receiver share the key) is out of scope, as in the paper.

The reconstruction is lossy: ``(s**2 - 1) / s**2`` of the pixels are estimated by the SR model. Only the
kept pixels are exact.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

__all__ = [
    "CIPHER_NAME", "keystream", "key_check", "encrypt", "decrypt", "compress", "decrypt_subsampled", "write_back",
    "reconstruct", "check_divisible",
]

#: the cipher's name, recorded with ciphertexts: modulo-256 addition of a SHAKE-256 stream, header version 1
CIPHER_NAME = "add-mod-256/shake256-v1"
_STREAM_DOMAIN = b"fedsight/etlc/keystream/shake256/v1"
_CHECK_DOMAIN = b"fedsight/etlc/key-check/shake256/v1"


def _as_bytes(value: bytes | bytearray | memoryview | str, what: str) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{what} must be bytes or str, got {type(value).__name__}")


def _field(data: bytes) -> bytes:
    """A length-prefixed header field (8-byte big-endian length): no two headers share an encoding."""
    return len(data).to_bytes(8, "big") + data


def _shape(shape: Sequence[int] | int) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if not dims or any(not isinstance(d, (int, np.integer)) or isinstance(d, bool) or d < 0 for d in dims):
        raise ValueError(f"a key stream shape must be a non-empty sequence of non-negative ints, got {shape!r}")
    return tuple(int(d) for d in dims)


def keystream(key: bytes | str, shape: Sequence[int] | int, nonce: bytes | str = b"") -> np.ndarray:
    """The key stream: a ``uint8`` array of ``shape``, from SHAKE-256 of a domain-separated header.

    The header is the length-prefixed encoding of (domain ``fedsight/etlc/keystream/shake256/v1``, key,
    nonce), then the number of dimensions and each dimension as 8-byte big-endian integers. One
    ``digest(prod(shape))`` call gives the whole stream. The stream is deterministic in
    ``(key, nonce, shape)``. Any change to one of them gives an unrelated stream.

    ``key`` and ``nonce`` are bytes. A ``str`` is UTF-8 encoded (a passphrase is only as strong as its
    entropy; prefer 16 or more random bytes). Security rests on never using the same ``(key, nonce)``
    for two images: see the module docstring (two-time pad).
    """
    k = _as_bytes(key, "key")
    if not k:
        raise ValueError("the key is empty")
    n_bytes = _as_bytes(nonce, "nonce")
    dims = _shape(shape)
    header = _field(_STREAM_DOMAIN) + _field(k) + _field(n_bytes) + len(dims).to_bytes(8, "big")
    header += b"".join(d.to_bytes(8, "big") for d in dims)
    n = math.prod(dims)
    return np.frombuffer(bytearray(hashlib.shake_256(header).digest(n)), dtype=np.uint8).reshape(dims)


def key_check(key: bytes | str) -> str:
    """A 32-bit key check value (8 hex digits): SHAKE-256 of a domain-separated encoding of the key, with
    a domain separate from the stream's. Stored with a ciphertext so that decrypting with the wrong key is
    an error, not a noise image. It tells nothing useful about the key itself. It confirms a guess, as
    any known plaintext would. It is no integrity check of the ciphertext."""
    k = _as_bytes(key, "key")
    if not k:
        raise ValueError("the key is empty")
    return hashlib.shake_256(_field(_CHECK_DOMAIN) + _field(k)).hexdigest(4)


def _uint8_image(x: np.ndarray, what: str) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{what} must be a numpy array, got {type(x).__name__}")
    if x.dtype != np.uint8:
        raise ValueError(f"{what} must hold uint8 pixels (0..255), got dtype {x.dtype}")
    if x.ndim not in (2, 3):
        raise ValueError(f"{what} must be [H, W] or [H, W, C] (channels last), got shape {x.shape}")
    return x


def encrypt(img: np.ndarray, key: bytes | str, nonce: bytes | str = b"") -> np.ndarray:
    """``(img + k) mod 256`` with ``k = keystream(key, img.shape, nonce)``. ``img``: uint8 ``[H, W, C]``
    (channels last) or ``[H, W]``. Use a fresh ``nonce`` per image."""
    x = _uint8_image(img, "the image")
    return np.add(x, keystream(key, x.shape, nonce), dtype=np.uint8)  # uint8 arithmetic wraps mod 256


def decrypt(cipher: np.ndarray, key: bytes | str, nonce: bytes | str = b"") -> np.ndarray:
    """``(cipher - k) mod 256``: the inverse of :func:`encrypt` with the same key and nonce."""
    c = _uint8_image(cipher, "the ciphertext")
    return np.subtract(c, keystream(key, c.shape, nonce), dtype=np.uint8)


def check_divisible(shape: Sequence[int], scale: int, offset: int = 0) -> None:
    """``ValueError`` unless ``scale`` >= 1, ``0 <= offset < scale``, and both sides of an
    ``[H, W, ...]`` shape are multiples of ``scale``. The message names the sizes."""
    if isinstance(scale, bool) or not isinstance(scale, (int, np.integer)) or scale < 1:
        raise ValueError(f"the scale must be an integer >= 1, got {scale!r}")
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or not 0 <= offset < scale:
        raise ValueError(f"the offset must be an integer in 0..{scale - 1} for scale {scale}, got {offset!r}")
    h, w = int(shape[0]), int(shape[1])
    if h % scale or w % scale or h == 0 or w == 0:
        raise ValueError(
            f"the image is {h}x{w} (HxW); down-sampling by {scale} needs both sides to be positive multiples of "
            f"{scale} (crop it to {h // scale * scale}x{w // scale * scale})"
        )


def compress(cipher: np.ndarray, scale: int, offset: int = 0) -> np.ndarray:
    """Uniform down-sampling, the lossy compression of the channel: ``cipher[o::s, o::s]`` (contiguous copy).

    It needs no key. H and W must be multiples of ``scale``, so the result is ``[H/s, W/s, ...]``."""
    c = _uint8_image(cipher, "the ciphertext")
    check_divisible(c.shape, scale, offset)
    return np.ascontiguousarray(c[offset::scale, offset::scale])


def decrypt_subsampled(
    c_sub: np.ndarray, key: bytes | str, nonce: bytes | str, full_shape: Sequence[int], scale: int, offset: int = 0
) -> np.ndarray:
    """Decrypt a down-sampled ciphertext: ``(c_sub - k[o::s, o::s]) mod 256``, with ``k`` the key stream of
    the full image (``full_shape``: the shape that was encrypted).

    This equals ``compress(plaintext, scale, offset)`` bit for bit. SHAKE-256 cannot seek, so the full
    stream is generated and sub-sampled; that is ``s**2`` times the bytes used, at hashing speed."""
    c = _uint8_image(c_sub, "the down-sampled ciphertext")
    full = _shape(full_shape)
    if len(full) != c.ndim:
        raise ValueError(f"the full shape {full} and the down-sampled ciphertext {c.shape} differ in rank")
    check_divisible(full, scale, offset)
    want = (full[0] // scale, full[1] // scale, *full[2:])
    if c.shape != want:
        raise ValueError(f"the down-sampled ciphertext is {c.shape}; a {full} image down-sampled by {scale} is {want}")
    k = keystream(key, full, nonce)[offset::scale, offset::scale]
    return np.subtract(c, k, dtype=np.uint8)


def write_back(sr: torch.Tensor, kept: torch.Tensor, scale: int, offset: int = 0) -> torch.Tensor:
    """The uniform down-sampling constraint (UDC): a copy of ``sr`` (``[..., C, sH, sW]``) with the kept
    pixels ``kept`` (``[..., C, H, W]``, same value scale) written over ``sr[..., o::s, o::s]``. This is one
    strided slice assignment; every other pixel is left as the model made it. ``kept`` is cast to
    ``sr``'s dtype and device."""
    if sr.ndim < 3 or kept.ndim != sr.ndim:
        raise ValueError(f"write_back needs [..., C, H, W] tensors of the same rank, got {tuple(sr.shape)} and "
                         f"{tuple(kept.shape)}")
    h, w = kept.shape[-2:]
    check_divisible((sr.shape[-2], sr.shape[-1]), scale, offset)
    if sr.shape[:-2] != kept.shape[:-2] or tuple(sr.shape[-2:]) != (h * scale, w * scale):
        raise ValueError(f"the SR output is {tuple(sr.shape)}; kept pixels {tuple(kept.shape)} at scale {scale} need "
                         f"{(*kept.shape[:-2], h * scale, w * scale)}")
    out = sr.clone()
    out[..., offset::scale, offset::scale] = kept.to(dtype=out.dtype, device=out.device)
    return out


def _model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def reconstruct(
    model: nn.Module, kept_uint8: np.ndarray, scale: int, offset: int = 0, device: torch.device | str | None = None
) -> np.ndarray:
    """Reconstruct the full-size image from its decrypted kept pixels: the SR model's output under the UDC.

    ``kept_uint8``: uint8 ``[h, w, 3]`` (or a batch ``[N, h, w, 3]``), channels last. ``model``: maps float
    ``[N, 3, h, w]`` in [0, 1] to ``[N, 3, s h, s w]`` in [0, 1]. It runs in eval mode without gradients;
    its training mode is restored afterwards. Its output is clamped to [0, 1] and rounded to 8 bits. Then
    the kept pixels are written back exactly (:func:`write_back`). The result is uint8
    ``[s h, s w, 3]`` (or ``[N, s h, s w, 3]``), and ``result[o::s, o::s] == kept_uint8``.

    ``device``: where the input goes; default is the model's device. The model is not moved.
    """
    if not isinstance(kept_uint8, np.ndarray) or kept_uint8.dtype != np.uint8 or kept_uint8.ndim not in (3, 4) \
            or kept_uint8.shape[-1] != 3:
        got = f"{kept_uint8.dtype} {kept_uint8.shape}" if isinstance(kept_uint8, np.ndarray) else type(kept_uint8).__name__
        raise ValueError(f"reconstruct needs uint8 RGB pixels [h, w, 3] or [N, h, w, 3], got {got}")
    check_divisible((scale, scale), scale, offset)  # checks scale and offset only
    single = kept_uint8.ndim == 3
    batch = kept_uint8[None] if single else kept_uint8
    dev = torch.device(device) if device is not None else _model_device(model)
    kept = torch.from_numpy(np.ascontiguousarray(batch)).to(dev).permute(0, 3, 1, 2).to(torch.float32)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            sr = model(kept / 255.0)
    finally:
        model.train(was_training)
    n, _, h, w = kept.shape
    if not isinstance(sr, torch.Tensor) or tuple(sr.shape) != (n, 3, h * scale, w * scale):
        got = tuple(sr.shape) if isinstance(sr, torch.Tensor) else type(sr).__name__
        raise ValueError(f"the SR model returned {got} for a {(n, 3, h, w)} input; scale {scale} needs "
                         f"{(n, 3, h * scale, w * scale)} (a model of another scale?)")
    sr8 = (torch.nan_to_num(sr.detach().to(torch.float32), nan=0.0).clamp(0, 1) * 255.0).round()
    out = write_back(sr8, kept, scale, offset).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return out[0] if single else out
