"""Appearance and rasterisation of the articulated figures of ``fedsight.data.figures``: a figure's body
parts as 2-D shapes, their clothes and textures, the painter's-algorithm canvas with its part-id map, and
the photographs cut into backgrounds and occluders.

A posed figure (``fedsight.data.figure_pose``) becomes a list of parts, each drawn as a filled shape,
farthest first (painter's algorithm on the depth of each part), so limbs cover each other as they would:

* the torso is the convex hull of the projected corners of a box (shoulder / hip breadth plus flesh,
  chest depth); upper arms, forearms, hands, thighs, shins, feet and the neck are tapered capsules (a
  cylinder's silhouette, shaded across its width); the head is the projected ellipse of an ellipsoid whose
  long axis runs from ``upper_neck`` to ``head_top``, with hair on the back and top and two eyes when the
  face is towards the camera (the one cue that separates front from back views, as in photographs);
* clothes: a shirt (torso, upper arms and, with long sleeves, the forearms), trousers (thighs and, when
  long, shins), shoes, skin (head, neck, hands, bare forearms / shins) and hair, each with a random
  colour and a procedural texture (plain, stripes, checks, smooth noise, or brick / grass / gravel detail
  from scikit-image's grey photographs).

The canvas records, per pixel, the id of what was drawn last there (``person * 16 + part``, the part
indices below; ``fedsight.data.figures`` gives its occluders ids from 100 up): :data:`OWN_PARTS` names
the parts whose pixels show a joint as visible.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from fedsight.data.figure_pose import (
    _FWD,
    _LEFT,
    _UP,
    HEAD_TOP,
    L_ANKLE,
    L_ELBOW,
    L_HIP,
    L_KNEE,
    L_SHOULDER,
    L_WRIST,
    PELVIS,
    R_ANKLE,
    R_ELBOW,
    R_HIP,
    R_KNEE,
    R_SHOULDER,
    R_WRIST,
    THORAX,
    UPPER_NECK,
)

# flesh radii (fractions of H) at the proximal / distal end of each capsule, and extra lengths
_R = {"upper_arm": (0.042, 0.032), "forearm": (0.032, 0.024), "hand": (0.026, 0.02), "thigh": (0.07, 0.047),
      "shin": (0.047, 0.032), "foot": (0.03, 0.024), "neck": (0.034, 0.032)}
_HAND_LEN, _FOOT_LEN, _HEEL = 0.065, 0.11, 0.025

# part indices within a figure (ids in the part map: person * 16 + part)
(TORSO, NECK, HEAD, R_UARM, R_FARM, R_HAND, L_UARM, L_FARM, L_HAND,
 R_THIGH, R_SHIN, R_FOOT, L_THIGH, L_SHIN, L_FOOT) = range(15)
#: the parts whose pixels show a joint as visible
OWN_PARTS: tuple[tuple[int, ...], ...] = (
    (R_SHIN, R_FOOT), (R_THIGH, R_SHIN), (R_THIGH, TORSO), (L_THIGH, TORSO), (L_THIGH, L_SHIN), (L_SHIN, L_FOOT),
    (TORSO, R_THIGH, L_THIGH), (TORSO, NECK), (NECK, HEAD), (HEAD,),
    (R_FARM, R_HAND), (R_UARM, R_FARM), (R_UARM, TORSO), (L_UARM, TORSO), (L_UARM, L_FARM), (L_FARM, L_HAND),
)

_SKIN = np.array([(255, 224, 196), (241, 194, 125), (224, 172, 105), (198, 134, 66), (141, 85, 36), (92, 58, 38)],
                 dtype=np.float32)
_HAIR = np.array([(20, 16, 14), (60, 40, 25), (110, 75, 40), (200, 170, 110), (150, 60, 30), (130, 130, 130)],
                 dtype=np.float32)


# ---------------------------------------------------------------------------------------- appearance


def _colour(rng: np.random.Generator, s=(0.2, 0.9), v=(0.25, 0.95)) -> np.ndarray:
    h, sat, val = rng.random(), rng.uniform(*s), rng.uniform(*v)
    i = int(h * 6) % 6
    f = h * 6 - int(h * 6)
    pp, q, t = val * (1 - sat), val * (1 - f * sat), val * (1 - (1 - f) * sat)
    rgb = [(val, t, pp), (q, val, pp), (pp, val, t), (pp, q, val), (t, pp, val), (val, pp, q)][i]
    return np.array(rgb, dtype=np.float32) * 255


def _texture(rng: np.random.Generator) -> tuple:
    kind = int(rng.choice(5, p=[0.3, 0.2, 0.1, 0.2, 0.2]))
    ang = rng.uniform(0, math.pi)
    return (kind, rng.uniform(3, 9), math.cos(ang), math.sin(ang), int(rng.integers(3)), rng.uniform(0.15, 0.5),
            int(rng.integers(512)), int(rng.integers(512)), _colour(rng))


def _sample_style(rng: np.random.Generator) -> dict:
    skin = np.clip(_SKIN[rng.integers(len(_SKIN))] * rng.uniform(0.9, 1.1), 0, 255)
    return {
        "skin": (skin, (0, 0, 0, 0, 0, 0.1, 0, 0, skin)),
        "hair": np.clip(_HAIR[rng.integers(len(_HAIR))] * rng.uniform(0.8, 1.2), 0, 255),
        "shirt": (_colour(rng), _texture(rng)),
        "pants": (_colour(rng, v=(0.15, 0.8)), _texture(rng)),
        "shoes": (_colour(rng, s=(0.0, 0.6), v=(0.05, 0.5)), (0, 0, 0, 0, 0, 0, 0, 0, None)),
        "long_sleeves": bool(rng.random() < 0.5),
        "long_pants": bool(rng.random() < 0.7),
    }


# ---------------------------------------------------------------------------------------- shapes


def _cross(u: np.ndarray, v: np.ndarray) -> float:
    return float(u[0] * v[1] - u[1] * v[0])


def _hull(pts: np.ndarray) -> np.ndarray:
    """Convex hull (monotone chain) of 2-D points, counter-clockwise."""
    pts = pts[np.lexsort((pts[:, 1], pts[:, 0]))]

    def half(points):
        out: list = []
        for p in points:
            while len(out) >= 2 and _cross(out[-1] - out[-2], p - out[-2]) <= 0:
                out.pop()
            out.append(p)
        return out

    lower, upper = half(pts), half(pts[::-1])
    return np.array(lower[:-1] + upper[:-1])


# ---------------------------------------------------------------------------------------- textures


@lru_cache(maxsize=1)
def _detail_tiles() -> np.ndarray:
    """Detail maps ``[4, 128, 128]`` with mean 1: brick, grass, gravel (grey photographs, sub-sampled) and
    smooth noise (a fixed constant, not drawn from the data's generator)."""
    from scipy.ndimage import gaussian_filter

    from fedsight.data.photos import load_photo

    tiles = []
    for name in ("brick", "grass", "gravel"):
        g = load_photo(name).numpy().mean(0)[128:384:2, 128:384:2]
        tiles.append(g / max(float(g.mean()), 1e-6))
    noise = gaussian_filter(np.random.default_rng(20240607).random((128, 128)), 4, mode="wrap")
    noise = 1 + (noise - noise.mean()) / (noise.std() + 1e-9) * 0.3
    tiles.append(noise)
    out = np.stack(tiles).astype(np.float32)
    return 1 + (out - 1) / np.maximum(np.abs(out - 1).max(axis=(1, 2), keepdims=True), 1e-6)  # deviations in [-1, 1]


def _shade(colour: np.ndarray, tex: tuple, ys: np.ndarray, xs: np.ndarray, light: np.ndarray) -> np.ndarray:
    """RGB ``[n, 3]`` of the pixels ``(ys, xs)``: a garment's colour and texture times the shading."""
    kind, period, c, s, tile, contrast, oy, ox, second = tex
    if kind == 1:  # stripes
        f = (np.floor((xs * c + ys * s) / period) % 2).astype(np.float32)
        rgb = colour[None] * (1 - f[:, None]) + second[None] * f[:, None]
    elif kind == 2:  # checks
        f = ((np.floor(xs / period) + np.floor(ys / period)) % 2).astype(np.float32)
        rgb = colour[None] * (1 - f[:, None]) + second[None] * f[:, None]
    elif kind == 3 or kind == 4:  # photo detail or smooth noise
        t = _detail_tiles()[tile if kind == 3 else 3]
        g = 1 + contrast * (t[(ys + oy) % 128, (xs + ox) % 128] - 1)
        rgb = colour[None] * g[:, None]
    else:
        rgb = np.broadcast_to(colour[None], (len(ys), 3))
    return rgb * light[:, None]


# ---------------------------------------------------------------------------------------- rasterising


class _Canvas:
    def __init__(self, image: np.ndarray):
        self.img = image  # float32 [H, W, 3]
        self.h, self.w = image.shape[:2]
        self.ids = np.full((self.h, self.w), -1, dtype=np.int16)

    def window(self, x0: float, x1: float, y0: float, y1: float):
        a, b = max(int(math.floor(x0)), 0), min(int(math.ceil(x1)) + 1, self.w)
        c, d = max(int(math.floor(y0)), 0), min(int(math.ceil(y1)) + 1, self.h)
        if a >= b or c >= d:
            return None
        return a, b, c, d, np.arange(a, b, dtype=np.float32)[None, :], np.arange(c, d, dtype=np.float32)[:, None]

    def paint(self, win, mask: np.ndarray, rgb_fn, pid: int) -> None:
        a, c = win[0], win[2]
        yy, xx = np.nonzero(mask)
        if len(yy) == 0:
            return
        ys, xs = yy + c, xx + a
        self.img[ys, xs] = rgb_fn(ys, xs, yy, xx)
        self.ids[ys, xs] = pid

    def capsule(self, p0, p1, r0: float, r1: float, colour, tex, pid: int) -> None:
        p0, p1, r0, r1 = (float(p0[0]), float(p0[1])), (float(p1[0]), float(p1[1])), float(r0), float(r1)  # float32 maths
        r = max(r0, r1)
        win = self.window(min(p0[0], p1[0]) - r, max(p0[0], p1[0]) + r, min(p0[1], p1[1]) - r, max(p0[1], p1[1]) + r)
        if win is None:
            return
        X, Y = win[4], win[5]
        dx, dy = p1[0] - p0[0], p1[1] - p0[1]
        L2 = dx * dx + dy * dy
        if L2 < 1e-9:
            t = np.zeros((len(Y), len(X[0])), dtype=np.float32)
        else:
            t = np.minimum(np.maximum(((X - p0[0]) * dx + (Y - p0[1]) * dy) / L2, 0), 1)
        ex, ey = X - (p0[0] + t * dx), Y - (p0[1] + t * dy)
        d2 = ex * ex + ey * ey
        rad = r0 + (r1 - r0) * t
        q = d2 / np.maximum(rad * rad, 1e-6)
        mask = q <= 1

        def rgb(ys, xs, yy, xx):
            return _shade(colour, tex, ys, xs, 0.62 + 0.38 * np.sqrt(1 - q[yy, xx]))

        self.paint(win, mask, rgb, pid)

    def polygon(self, pts: np.ndarray, colour, tex, pid: int) -> None:
        """A convex polygon (counter-clockwise in x-right / y-down axes, as :func:`_hull` gives)."""
        win = self.window(pts[:, 0].min(), pts[:, 0].max(), pts[:, 1].min(), pts[:, 1].max())
        if win is None:
            return
        X, Y = win[4], win[5]
        mask = np.ones((len(Y), X.shape[1]), dtype=bool)
        for k in range(len(pts)):
            (x0, y0), (x1, y1) = pts[k], pts[(k + 1) % len(pts)]
            mask &= (x1 - x0) * (Y - y0) - (y1 - y0) * (X - x0) >= 0
        cx = float(pts[:, 0].mean())
        span = max(float(np.ptp(pts[:, 0])) / 2, 1.0)

        def rgb(ys, xs, yy, xx):
            light = 0.72 + 0.28 * np.sqrt(np.maximum(1 - ((xs - cx) / span) ** 2, 0))
            return _shade(colour, tex, ys, xs, light)

        self.paint(win, mask, rgb, pid)

    def head(self, c, axis, A: float, B: float, fwd2: np.ndarray, fz: float, eyes, style, pid: int) -> None:
        A = A + 0.75  # the crown joint lies on the ellipse: keep its pixel inside
        ex = math.sqrt((A * axis[0]) ** 2 + (B * axis[1]) ** 2)
        ey = math.sqrt((A * axis[1]) ** 2 + (B * axis[0]) ** 2)
        win = self.window(c[0] - ex, c[0] + ex, c[1] - ey, c[1] + ey)
        if win is None:
            return
        X, Y = win[4] - float(c[0]), win[5] - float(c[1])
        axis, fwd2, A, B = (float(axis[0]), float(axis[1])), (float(fwd2[0]), float(fwd2[1])), float(A), float(B)
        a = X * axis[0] + Y * axis[1]  # along the head's axis, towards the crown
        b = -X * axis[1] + Y * axis[0]
        q = (a / A) ** 2 + (b / B) ** 2
        mask = q <= 1
        # hair: the crown and the back of the head (all of it seen from behind)
        back = -(X * fwd2[0] + Y * fwd2[1]) / B
        hair = (a / A + 0.8 * back) > (-1.5 + 0.975 * (fz + 1))
        skin_c, skin_t = style["skin"]
        hair_c = style["hair"]

        def rgb(ys, xs, yy, xx):
            light = 0.65 + 0.35 * np.sqrt(1 - q[yy, xx])
            out = _shade(skin_c, skin_t, ys, xs, light)
            h = hair[yy, xx]
            out[h] = hair_c[None] * light[h, None]
            for e in eyes:
                de = (xs - e[0]) ** 2 + (ys - e[1]) ** 2 <= max(0.9, 0.11 * B) ** 2
                out[de & ~h] = (25, 20, 20)
            return out

        self.paint(win, mask, rgb, pid)

    def occluder(self, x0: float, y0: float, w: float, h: float, ellipse: bool, patch_fn, pid: int) -> None:
        win = self.window(x0, x0 + w, y0, y0 + h)
        if win is None:
            return
        X, Y = win[4], win[5]
        if ellipse:
            mask = ((X - (x0 + w / 2)) / (w / 2)) ** 2 + ((Y - (y0 + h / 2)) / (h / 2)) ** 2 <= 1
        else:
            mask = (X >= x0) & (X <= x0 + w) & (Y >= y0) & (Y <= y0 + h)
        self.paint(win, mask, lambda ys, xs, yy, xx: patch_fn(ys, xs), pid)


# ---------------------------------------------------------------------------------------- images


_PHOTO_MAX_SIDE = 640


@lru_cache(maxsize=32)
def _photo(name: str) -> np.ndarray:
    """A shipped photograph as float32 ``[H, W, 3]`` (0..255), shrunk (antialiased) to a longer side of at
    most 640 pixels: backgrounds are crops of 35-100 % of it, so nothing finer is ever needed."""
    from fedsight.data.photos import load_photo

    img = load_photo(name).numpy().transpose(1, 2, 0)
    h, w = img.shape[:2]
    if max(h, w) > _PHOTO_MAX_SIDE:
        from skimage.transform import resize

        f = _PHOTO_MAX_SIDE / max(h, w)
        img = resize(img, (round(h * f), round(w * f)), order=1, anti_aliasing=True, preserve_range=True)
    return np.ascontiguousarray(img, dtype=np.float32)


@lru_cache(maxsize=32)
def _photo_pil(name: str):
    from PIL import Image

    return Image.fromarray(np.clip(np.rint(_photo(name)), 0, 255).astype(np.uint8))


def _background(name: str, hw: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """A random crop (35-100 % of the largest window of the image's aspect) of photograph ``name``, resampled
    to ``hw`` (PIL bilinear, sub-pixel crop box), mirrored with probability 1/2, gain 0.8-1.2."""
    from PIL import Image

    H, W = hw
    photo = _photo_pil(name)
    pw, ph = photo.size
    full = min(ph, pw * H / W)
    ch = full * rng.uniform(0.35, 1.0)
    cw = ch * W / H
    y0, x0 = rng.uniform(0, ph - ch), rng.uniform(0, pw - cw)
    flip, gain = rng.random() < 0.5, rng.uniform(0.8, 1.2)
    out = np.asarray(photo.resize((W, H), Image.Resampling.BILINEAR, box=(x0, y0, x0 + cw, y0 + ch)), dtype=np.float32)
    if flip:
        out = out[:, ::-1]
    return np.ascontiguousarray(out * np.float32(gain))


def _person_parts(cam: np.ndarray, geo: dict, body: dict, style: dict) -> list[tuple]:
    """The parts of one figure in unit coordinates (x right, y down, unit = height):
    ``(depth, part, kind, geometry, colour, texture)``."""
    P = np.stack([cam[:, 0], -cam[:, 1]], 1)
    Z = cam[:, 2]
    k = body["build"]

    def v2(v):
        return np.array([v[0], -v[1]])

    shirt, pants, skin, shoes = style["shirt"], style["pants"], style["skin"], style["shoes"]
    fore_c = shirt if style["long_sleeves"] else skin
    shin_c = pants if style["long_pants"] else skin
    parts = []
    corners = geo["trunk_corners"]
    parts.append((float(Z[[PELVIS, THORAX]].mean()) - 0.005, TORSO, "poly", _hull(np.stack([corners[:, 0], -corners[:, 1]], 1)), *shirt))
    parts.append((float(Z[[THORAX, UPPER_NECK]].mean()), NECK, "cap", (P[THORAX], P[UPPER_NECK], *(r * k for r in _R["neck"])), *skin))
    for side, (sh, el, wr, hip, kn, an) in enumerate(((R_SHOULDER, R_ELBOW, R_WRIST, R_HIP, R_KNEE, R_ANKLE),
                                                      (L_SHOULDER, L_ELBOW, L_WRIST, L_HIP, L_KNEE, L_ANKLE))):
        uarm, farm, hand, thigh, shin, foot = ((R_UARM, R_FARM, R_HAND, R_THIGH, R_SHIN, R_FOOT) if side == 0 else
                                               (L_UARM, L_FARM, L_HAND, L_THIGH, L_SHIN, L_FOOT))
        hand_end = cam[wr] + geo[("hand", side)] * _HAND_LEN
        heel, toe = cam[an] - geo[("foot", side)] * _HEEL, cam[an] + geo[("foot", side)] * _FOOT_LEN
        b = 0.01  # limbs win ties with the trunk
        parts += [
            ((Z[sh] + Z[el]) / 2 + b, uarm, "cap", (P[sh], P[el], *(r * k for r in _R["upper_arm"])), *shirt),
            ((Z[el] + Z[wr]) / 2 + b, farm, "cap", (P[el], P[wr], *(r * k for r in _R["forearm"])), *fore_c),
            ((Z[wr] + hand_end[2]) / 2 + b, hand, "cap", (P[wr], v2(hand_end), *(r * k for r in _R["hand"])), *skin),
            ((Z[hip] + Z[kn]) / 2 + b, thigh, "cap", (P[hip], P[kn], *(r * k for r in _R["thigh"])), *pants),
            ((Z[kn] + Z[an]) / 2 + b, shin, "cap", (P[kn], P[an], *(r * k for r in _R["shin"])), *shin_c),
            ((heel[2] + toe[2]) / 2 + b, foot, "cap", (v2(heel), v2(toe), *(r * k for r in _R["foot"])), *shoes),
        ]
    # head: the projection of an ellipsoid with semi-axes (B, A3, B) along (left, up, forward) of the head
    head = geo["head"]
    up, fwd, left = head @ _UP, head @ _FWD, head @ _LEFT
    c3 = (cam[UPPER_NECK] + cam[HEAD_TOP]) / 2
    B = body["head_width"] * (0.92 + 0.16 * (k - 0.85) / 0.35)
    half = np.linalg.norm(P[HEAD_TOP] - P[UPPER_NECK]) / 2
    A3 = body["head"] / 2
    cos2 = min(1.0, (half / max(A3, 1e-9)) ** 2)
    A = math.sqrt(half**2 + B**2 * (1 - cos2))
    axis = v2(up)
    axis = axis / np.linalg.norm(axis) if np.linalg.norm(axis) > 1e-6 else np.array([0.0, -1.0])
    eyes = []
    if fwd[2] > 0.15:
        for s in (-1, 1):
            e = c3 + 0.9 * B * fwd + 0.38 * B * s * left + 0.1 * A3 * up
            eyes.append(v2(e))
    parts.append((float(c3[2]) + 0.012, HEAD, "head", (v2(c3), axis, A, B, v2(fwd), float(fwd[2]), eyes), style, None))
    return parts


def _extent(parts: list[tuple]) -> np.ndarray:
    """``[x1, y1, x2, y2]`` of the drawn silhouette, in the parts' coordinates."""
    lo, hi = np.full(2, np.inf), np.full(2, -np.inf)
    for _, _, kind, g, *_ in parts:
        if kind == "poly":
            a, b = g.min(0), g.max(0)
        elif kind == "cap":
            p0, p1, r0, r1 = g
            a, b = np.minimum(p0 - r0, p1 - r1), np.maximum(p0 + r0, p1 + r1)
        else:
            c, axis, A, B = g[:4]
            e = np.array([math.hypot(A * axis[0], B * axis[1]), math.hypot(A * axis[1], B * axis[0])])
            a, b = c - e, c + e
        lo, hi = np.minimum(lo, a), np.maximum(hi, b)
    return np.concatenate([lo, hi])


def _scaled(parts: list[tuple], s: float, off: np.ndarray) -> list[tuple]:
    out = []
    for depth, part, kind, g, colour, tex in parts:
        if kind == "poly":
            g = g * s + off
        elif kind == "cap":
            g = (g[0] * s + off, g[1] * s + off, g[2] * s, g[3] * s)
        else:
            c, axis, A, B, fwd2, fz, eyes = g
            g = (c * s + off, axis, A * s, B * s, fwd2, fz, [e * s + off for e in eyes])
        out.append((depth, part, kind, g, colour, tex))
    return out
