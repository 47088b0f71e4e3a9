"""Rasteriser, textures and shaders behind ``fedsight.data.street_scenes`` (see that module for the scene
model and the randomness contract).

Geometry. World coordinates are road-aligned metres: ``X`` lateral (right positive, 0 = road centre),
``Y`` up (0 = ground), ``Z`` forward along the road. A :class:`View` bends the road sideways by
``curv * Z**2``, moves the camera to ``(cam_x, cam_h, 0)`` and projects with a pinhole of focal ``f``
pixels whose horizon is the image row ``cy``. Every object is a planar parallelogram (:class:`Prim`, a
corner ``p0`` and two edges ``a`` and ``b``); for a pixel the ray-plane intersection gives, in closed form
(Cramer's rule, affine numerators and denominator in the pixel coordinates), the quad coordinates
``s, t`` in ``[0, 1]`` and the depth ``Z``. A kind-specific shader cuts the silhouette out of the quad
(a person, a tree crown, a car's cabin) and colours it from texture patches. Quads are drawn back to
front (painter's algorithm) with a depth test, so occlusion is exact in the image, the label map and
the depth map alike; the ground (road, sidewalks, terrain) and the sky are rendered per pixel first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from fedsight.data.photos import load_photo

__all__ = ["SHADERS", "Canvas", "CrossSection", "Prim", "View", "add_glows", "draw_ground", "draw_prims", "draw_quad", "draw_sky",
           "sample", "texture"]

TEX = 256  # texture side (a power of two, so texel wrap-around is a bit mask)
_LEVELS = (0.0, 1.0, 2.0, 4.0)  # blur of the "mip" levels (all kept at TEX x TEX)
_TEXTURES: dict[str, np.ndarray] = {}


def texture(name: str) -> np.ndarray:
    """A tileable-enough texture ``[levels, TEX, TEX(, 3)]`` float32: grey photos (brick, grass, gravel,
    camera) as detail with mean 1, colour photos as RGB in 0..1, "clouds" as smooth noise in 0..1."""
    if name not in _TEXTURES:
        from scipy.ndimage import gaussian_filter
        from skimage.transform import resize

        if name == "clouds":
            img = gaussian_filter(np.random.default_rng(7).random((TEX, TEX)), 10, mode="wrap")
            img = (img - img.min()) / (img.max() - img.min())
        else:
            img = load_photo(name).numpy().transpose(1, 2, 0) / 255.0
            side = min(img.shape[:2])
            y0, x0 = (img.shape[0] - side) // 2, (img.shape[1] - side) // 2
            img = resize(img[y0 : y0 + side, x0 : x0 + side], (TEX, TEX), anti_aliasing=True)
            if np.allclose(img[..., 0], img[..., 2]):
                img = img.mean(-1) / max(img.mean(), 1e-6)
        sig = (lambda s: (s, s)) if img.ndim == 2 else (lambda s: (s, s, 0))
        levels = [img if s == 0 else gaussian_filter(img, sig(s), mode="wrap") for s in _LEVELS]
        _TEXTURES[name] = np.ascontiguousarray(np.stack(levels), dtype=np.float32)
    return _TEXTURES[name]


def level(texels_per_pixel: np.ndarray | float) -> np.ndarray:
    """Blur level for a texel density (texels per pixel), 0..3."""
    return np.clip(np.log2(np.maximum(texels_per_pixel, 1e-3)) + 0.5, 0, len(_LEVELS) - 1).astype(np.int64)


def sample(name: str, x: np.ndarray, y: np.ndarray, lvl) -> np.ndarray:
    """Nearest-texel lookup at texel coordinates ``x, y`` (wrapping) and blur level ``lvl``."""
    tex = texture(name)
    return tex[lvl, np.floor(y).astype(np.int64) & (TEX - 1), np.floor(x).astype(np.int64) & (TEX - 1)]


def detail(name: str, x, y, lvl, contrast: float) -> np.ndarray:
    """Grey texture detail around 1 with the given contrast."""
    return 1.0 + contrast * (sample(name, x, y, lvl) - 1.0)


def hash01(a: np.ndarray, b: np.ndarray, seed: float) -> np.ndarray:
    """A cheap deterministic pseudo-random value in [0, 1) per integer cell ``(a, b)``."""
    v = np.sin(a * 12.9898 + b * 78.233 + seed * 37.719) * 43758.5453
    return v - np.floor(v)


@dataclass(frozen=True)
class View:
    """Camera of one rendering: image size, focal (px), horizon row ``cy`` (px), camera height and lateral
    position (m), road bend ``curv`` (1/m)."""

    height: int
    width: int
    f: float
    cy: float
    cam_h: float
    cam_x: float
    curv: float

    @property
    def cx(self) -> float:
        return self.width / 2.0

    def to_cam(self, p) -> np.ndarray:
        x, y, z = p
        return np.array([x + self.curv * z * z - self.cam_x, y - self.cam_h, z], dtype=np.float64)

    def project(self, p) -> tuple[float, float, float]:
        """Pixel coordinates ``(u, v)`` and depth of a world point."""
        x, y, z = self.to_cam(p)
        return self.cx + self.f * x / z, self.cy - self.f * y / z, z


@dataclass
class Prim:
    """A planar parallelogram ``p0 + s a + t b`` (``s, t`` in [0, 1]) of class ``cls`` drawn by shader
    ``kind`` with ``params``; ``wm, hm`` are the metric lengths of ``a`` and ``b`` (texture scale)."""

    kind: str
    cls: int
    p0: tuple[float, float, float]
    a: tuple[float, float, float]
    b: tuple[float, float, float]
    params: dict = field(default_factory=dict)

    @property
    def wm(self) -> float:
        return math.hypot(*self.a)

    @property
    def hm(self) -> float:
        return math.hypot(*self.b)

    def near(self) -> float:
        return min(self.p0[2], self.p0[2] + self.a[2], self.p0[2] + self.b[2], self.p0[2] + self.a[2] + self.b[2])


class Canvas:
    """Colour (float, 0..1 albedo), label, depth (m; inf = sky), emission (lit windows) and object-id
    buffers of one rendering (object id -1: ground or sky)."""

    def __init__(self, height: int, width: int):
        self.rgb = np.zeros((height, width, 3), np.float32)
        self.label = np.zeros((height, width), np.uint8)
        self.z = np.full((height, width), np.inf, np.float32)
        self.emit = np.zeros((height, width), np.float32)
        self.oid = np.full((height, width), -1, np.int32)


def _cross(a, b) -> tuple[float, float, float]:
    return (a[1] * b[2] - a[2] * b[1], a[2] * b[0] - a[0] * b[2], a[0] * b[1] - a[1] * b[0])


def _spans(us: list, vs: list, width: int, height: int):
    """Rows and columns of the pixel centres inside the convex polygon with vertices ``(us, vs)`` (in
    order): its left and right chains from the top vertex to the bottom one, interpolated per row."""
    i0, i1 = max(math.ceil(min(vs) - 0.5), 0), min(math.floor(max(vs) - 0.5), height - 1)
    if i1 < i0 or max(us) < 0.5 or min(us) > width - 0.5:
        return None
    top, bot = vs.index(min(vs)), vs.index(max(vs))
    fwd, bwd = [top], [top]
    while fwd[-1] != bot:
        fwd.append((fwd[-1] + 1) % 4)
    while bwd[-1] != bot:
        bwd.append((bwd[-1] - 1) % 4)
    yc = np.arange(i0, i1 + 1) + 0.5
    x1 = np.interp(yc, [vs[k] for k in fwd], [us[k] for k in fwd])
    x2 = np.interp(yc, [vs[k] for k in bwd], [us[k] for k in bwd])
    left = np.maximum(np.ceil(np.minimum(x1, x2) - 0.5), 0).astype(np.int64)
    counts = np.maximum(np.minimum(np.floor(np.maximum(x1, x2) - 0.5), width - 1).astype(np.int64) - left + 1, 0)
    total = int(counts.sum())
    if total == 0:
        return None
    rows = np.repeat(np.arange(i0, i1 + 1), counts)
    cols = np.arange(total) + np.repeat(left - (np.cumsum(counts) - counts), counts)
    return rows, cols


def draw_quad(cv: Canvas, view: View, prim: Prim, oid: int, shader, s_range=(0.0, 1.0)) -> int:
    """Rasterise one quad (or the ``s_range`` part of it) with a depth test; returns pixels written.

    The pixels whose centres fall inside the projected quad are enumerated row by row (spans of a convex
    polygon); for them the ray-plane intersection gives ``s, t`` and the depth in closed form. Horizontal
    quads at or above the camera (their underside) are skipped: the box they top hides them."""
    (px, py, pz), (ax, ay, az), (bx, by, bz) = prim.p0, prim.a, prim.b
    if ay == 0 and by == 0 and py >= view.cam_h:
        return 0
    s0, s1 = s_range
    ds, f, curv = s1 - s0, view.f, view.curv
    qx, qy, qz = px + s0 * ax, py + s0 * ay, pz + s0 * az
    ex, ey, ez = qx + ds * ax, qy + ds * ay, qz + ds * az
    pts = ((qx, qy, qz), (ex, ey, ez), (ex + bx, ey + by, ez + bz), (qx + bx, qy + by, qz + bz))  # polygon order
    cam = [(x + curv * z * z - view.cam_x, y - view.cam_h, z) for x, y, z in pts]
    if min(c[2] for c in cam) < 0.3:
        return 0
    us = [view.cx + f * c[0] / c[2] for c in cam]
    vs = [view.cy - f * c[1] / c[2] for c in cam]
    span = _spans(us, vs, view.width, view.height)
    if span is None:
        return 0
    P00 = cam[0]
    A = tuple(cam[1][k] - P00[k] for k in range(3))
    B = tuple(cam[3][k] - P00[k] for k in range(3))
    R = (-P00[0], -P00[1], -P00[2])
    N, Ks, Kt = _cross(A, B), _cross(R, B), _cross(A, R)
    zn = P00[0] * N[0] + P00[1] * N[1] + P00[2] * N[2]
    if abs(zn) < 1e-9:  # the camera lies in the quad's plane
        return 0
    rows, cols = span
    flat = rows * view.width + cols
    # a ray-plane quantity d . K with d = ((u - cx) / f, -(v - cy) / f, 1) at pixel centres (col, row)
    ru, rv, r0 = 1.0 / f, -1.0 / f, (0.5 - view.cx) / f
    r1 = -(0.5 - view.cy) / f
    colf, rowf = cols.astype(np.float32), rows.astype(np.float32)

    def dot(K):
        return colf * np.float32(K[0] * ru) + (rowf * np.float32(K[1] * rv) + np.float32(K[0] * r0 + K[1] * r1 + K[2]))

    inv = np.float32(1.0) / dot(N)
    z = inv * np.float32(zn)
    vis = z <= cv.z.reshape(-1)[flat]
    if not vis.all():
        flat, colf, rowf, inv, z = flat[vis], colf[vis], rowf[vis], inv[vis], z[vis]
        if flat.size == 0:
            return 0
    s = np.clip(dot(Ks) * inv, 0, 1)
    t = np.clip(dot(Kt) * inv, 0, 1)
    if s_range != (0.0, 1.0):
        s = s0 + s * ds
    keep, rgb, emit = shader(s, t, z, z * np.float32(1.0 / f), prim)
    if keep is not None:
        flat, z = flat[keep], z[keep]
    cv.rgb.reshape(-1, 3)[flat] = rgb
    cv.label.reshape(-1)[flat] = prim.cls
    cv.z.reshape(-1)[flat] = z
    cv.emit.reshape(-1)[flat] = emit
    cv.oid.reshape(-1)[flat] = oid
    return flat.size


def draw_prims(cv: Canvas, view: View, prims: list[Prim], shaders: dict, max_seg: float = 20.0) -> None:
    """Draw ``prims`` back to front (far first, by nearest corner depth; stable for ties). Long quads along
    the road are split into pieces of at most ``max_seg`` metres so they follow the road's bend."""
    order = sorted(range(len(prims)), key=lambda i: -prims[i].near())
    for i in order:
        p = prims[i]
        shader = shaders[p.kind]
        pieces = math.ceil(abs(p.a[2]) / max_seg) if view.curv != 0.0 else 1
        if pieces <= 1:
            draw_quad(cv, view, p, i, shader)
        else:
            edges = np.linspace(0.0, 1.0, pieces + 1)
            for k in range(pieces):
                draw_quad(cv, view, p, i, shader, (float(edges[k]), float(edges[k + 1])))


# ----------------------------------------------------------------------------------------- shaders
# A shader takes the quad coordinates ``s, t`` (1-D, in [0, 1]), depth ``z`` and metres per pixel
# ``pxm`` of the pixels a quad covers, and returns (which of them the silhouette keeps or None for all,
# their albedo [n, 3], their emission [n] or a scalar). Silhouettes may use only layout parameters
# (``hseed``, ``soff``, geometry); colours may also use the appearance offsets ``off`` and ``seed``.


def _rgb(c) -> np.ndarray:
    return np.asarray(c, np.float32)


def _col(base, d) -> np.ndarray:
    return _rgb(base)[None, :] * np.asarray(d, np.float32)[:, None]


def _lv(pxm, tpm) -> np.ndarray:
    return level(pxm * tpm)


def _seg_dist(x, y, p, q) -> np.ndarray:
    """Distance of points ``(x, y)`` to the segment ``p q``."""
    dx, dy = q[0] - p[0], q[1] - p[1]
    h = np.clip(((x - p[0]) * dx + (y - p[1]) * dy) / (dx * dx + dy * dy), 0, 1)
    return np.hypot(x - p[0] - h * dx, y - p[1] - h * dy)


def sh_facade(s, t, z, pxm, pr):
    p, wm, hm = pr.params, pr.wm, pr.hm
    x, y = s * wm, t * hm
    (ox, oy), mat, tpm = p["off"], p["material"], 48.0
    lv = _lv(pxm, tpm)
    if mat == "brick":
        d = detail("brick", x * tpm + ox, y * tpm + oy, lv, 0.55)
    elif mat == "metal":
        d = (1.0 + 0.18 * np.sin(x * (2 * np.pi / 0.5))) * detail("gravel", x * tpm + ox, y * tpm + oy, lv, 0.1)
    else:
        d = detail("gravel", x * tpm + ox, y * tpm + oy, lv, 0.15 if mat == "plaster" else 0.05)
    col = _col(p["tint"], d)
    gx, gy = x / p["bay"], y / p["floor"]
    cx, cy = np.floor(gx), np.floor(gy)
    fx, fy = gx - cx, gy - cy
    wx, wy = p["window"]
    win = (np.abs(fx - 0.5) < wx) & (np.abs(fy - 0.55) < wy) & (cy >= 1) & (y < hm - 0.8)
    if p["shops"]:
        win |= (cy == 0) & (np.abs(fx - 0.5) < 0.42) & (fy > 0.08) & (fy < 0.75)
    glass = np.stack([0.09 + 0.16 * fy, 0.11 + 0.18 * fy, 0.15 + 0.22 * fy], -1).astype(np.float32) * _rgb(p["glass"])
    col = np.where(win[:, None], glass, col)
    col *= (p["shade"] * (0.72 + 0.28 * np.minimum(y / 3.0, 1.0)) * np.where(y > hm - 0.45, 1.2, 1.0)).astype(np.float32)[:, None]
    emit = (win & (hash01(cx, cy, p["seed"]) < p["lit"])).astype(np.float32)
    return None, col, emit


def sh_skyline(s, t, z, pxm, pr):
    p, x, y = pr.params, s * pr.wm, t * pr.hm
    b = np.floor(x / p["bin"])
    h = pr.hm * (0.25 + 0.75 * hash01(b, 1.0, p["hseed"])) * (hash01(b, 2.0, p["hseed"]) > p["gaps"])
    keep = y < h
    x, y, b = x[keep], y[keep], b[keep]
    win = ((x % 3.0) < 1.4) & ((y % 3.5) < 1.6)
    d = 0.92 + 0.16 * hash01(b, 3.0, p["hseed"])
    col = _col(p["tint"], d * np.where(win, 0.8, 1.0))
    emit = (win & (hash01(np.floor(x / 3.0), np.floor(y / 3.5), p["seed"]) < p["lit"])).astype(np.float32)
    return keep, col, emit


def sh_treeline(s, t, z, pxm, pr):
    p, x, y = pr.params, s * pr.wm, t * pr.hm
    f1, f2 = p["phase"]
    h = pr.hm * (0.6 + 0.22 * np.sin(x / 9.0 + f1) + 0.18 * np.sin(x / 2.7 + f2))
    keep = y < h
    d = detail("grass", x[keep] * 6 + p["off"][0], y[keep] * 6 + p["off"][1], 2, 0.6)
    return keep, _col(p["tint"], d * (0.7 + 0.3 * y[keep] / pr.hm)), 0.0


def sh_hedge(s, t, z, pxm, pr):
    p, x, y = pr.params, s * pr.wm, t * pr.hm
    keep = y < pr.hm * (0.85 + 0.15 * np.sin(x / 0.8 + p["phase"]))
    x, y = x[keep], y[keep]
    d = detail("grass", x * 40 + p["off"][0], y * 40 + p["off"][1], _lv(pxm[keep], 40), 0.7)
    return keep, _col(p["tint"], d * (0.65 + 0.35 * y / pr.hm)), 0.0


def sh_wall(s, t, z, pxm, pr):
    p, x, y = pr.params, s * pr.wm, t * pr.hm
    (ox, oy), style = p["off"], p["style"]
    d = detail("gravel", x * 48 + ox, y * 48 + oy, _lv(pxm, 48), 0.2)
    if style == "fence":  # wooden boards
        d = d * np.where((x % 0.3) < 0.25, 1.0, 0.55) * (0.9 + 0.1 * np.sin(y * 9.0))
    elif style == "mesh":  # chain-link with posts
        d = d * np.where(np.abs(((x + y) % 0.2) - 0.1) < 0.03, 1.25, 0.75) * np.where((x % 2.5) < 0.12, 0.5, 1.0)
    else:  # concrete with a cap
        d = d * np.where(y > pr.hm - 0.12, 1.25, 1.0) * np.where((x % 4.0) < 0.05, 0.7, 1.0)
    return None, _col(p["tint"], d * p["shade"]), 0.0


def sh_pole(s, t, z, pxm, pr):
    return None, _col(pr.params["tint"], 0.5 + 0.5 * np.sin(np.pi * s)), 0.0


def sh_light(s, t, z, pxm, pr):
    p, x, y = pr.params, s * pr.wm, t * pr.hm
    col = np.full((s.size, 3), 0.06, np.float32)
    colours = ((0.95, 0.1, 0.05), (0.95, 0.65, 0.05), (0.1, 0.9, 0.35))
    for k, yc in enumerate((0.8, 0.5, 0.2)):
        lamp = np.hypot(x - pr.wm / 2, y - yc * pr.hm) < 0.12
        col[lamp] = _rgb(colours[k]) * (1.0 if p["state"] == k else 0.25)
    return None, col, 0.0


_SIGN_COLOURS = {"circle": ((0.8, 0.08, 0.08), (0.95, 0.95, 0.95)), "triangle": ((0.85, 0.1, 0.1), (0.95, 0.92, 0.85)),
                 "square": ((0.1, 0.25, 0.7), (0.92, 0.92, 0.95)), "rect": ((0.05, 0.45, 0.2), (0.95, 0.95, 0.95))}


def sh_sign(s, t, z, pxm, pr):
    shape = pr.params["shape"]
    u, v = s - 0.5, t - 0.5
    if shape == "circle":
        r = np.hypot(u, v)
        keep, inner = r < 0.5, r < 0.33
    elif shape == "triangle":
        keep = (t < 0.92) & (np.abs(u) < 0.5 * (0.92 - t) / 0.92 + 0.02)
        inner = (t > 0.14) & (t < 0.72) & (np.abs(u) < 0.5 * (0.72 - t) / 0.72 - 0.02)
    else:
        keep, inner = np.ones_like(s, bool), (np.abs(u) < 0.4) & (np.abs(v) < 0.36)
    outer_c, inner_c = _SIGN_COLOURS[shape]
    col = np.where(inner[keep][:, None], _rgb(inner_c), _rgb(outer_c)) * np.float32(pr.params["shade"])
    return keep, col, 0.0


def sh_tree(s, t, z, pxm, pr):
    p, x, y = pr.params, s * pr.wm, t * pr.hm
    cy, ry, rx = pr.hm * p["crown_y"], pr.hm * (1 - p["crown_y"]), pr.wm / 2
    r2 = ((x - rx) / rx) ** 2 + ((y - cy) / ry) ** 2
    lump = sample("grass", x * 3 + p["soff"][0], y * 3 + p["soff"][1], 3)
    crown = r2 < 0.75 + 0.5 * (lump - 1.0)
    trunk = (np.abs(x - rx) < np.maximum(0.14, 0.6 * pxm)) & (y < cy)
    keep = crown | trunk
    x, y, crown = x[keep], y[keep], crown[keep]
    d = detail("grass", x * 30 + p["off"][0], y * 30 + p["off"][1], _lv(pxm[keep], 30), 0.8)
    light = 0.6 + 0.5 * np.clip((y - cy) / ry + 0.5, 0, 1)
    col = np.where(crown[:, None], _col(p["tint"], d * light), _rgb((0.28, 0.2, 0.12)) * 0.8)
    return keep, col, 0.0


def sh_person(s, t, z, pxm, pr):
    p, st = pr.params, pr.params["stride"]
    u = s - 0.5
    head = (u / 0.17) ** 2 + ((t - 0.915) / 0.075) ** 2 < 1
    torso = (np.abs(u) < 0.25 - 0.1 * np.maximum(t - 0.8, 0) / 0.05) & (t > 0.48) & (t < 0.85)
    arms = (np.abs(u) < 0.36) & (np.abs(u) > 0.2) & (t > 0.52) & (t < 0.83)
    legs = (t <= 0.5) & ((np.abs(u - st * (0.5 - t)) < 0.1) | (np.abs(u + st * (0.5 - t)) < 0.1))
    keep = head | torso | arms | legs
    u, t, head, legs = u[keep], t[keep], head[keep], legs[keep]
    cloth = sample(p["cloth"], (u * 40 + p["off"][0]), t * 60 + p["off"][1], 1) * _rgb(p["shirt"]) * 1.6
    col = np.where(legs[:, None], _rgb(p["trousers"]) * (0.8 + 0.4 * t[:, None]), cloth)
    col = np.where(head[:, None], np.where((t > 0.95)[:, None], _rgb(p["hair"]), _rgb(p["skin"])), col)
    return keep, col.astype(np.float32), 0.0


def sh_rider(s, t, z, pxm, pr):
    p = pr.params
    x, y = (1 - s if p["flip"] else s) * pr.wm, t * pr.hm
    wheel = np.minimum(np.hypot(x - 0.4, y - 0.34), np.hypot(x - 1.4, y - 0.34))
    frame = (_seg_dist(x, y, (0.4, 0.34), (0.85, 0.85)) < 0.08) | (_seg_dist(x, y, (0.85, 0.85), (1.35, 0.95)) < 0.08)
    frame |= _seg_dist(x, y, (1.4, 0.34), (1.35, 1.05)) < 0.07
    leg = _seg_dist(x, y, (0.85, 0.95), (1.0, 0.42)) < 0.1
    torso = _seg_dist(x, y, (0.85, 1.0), (1.12, 1.42)) < 0.19
    arm = _seg_dist(x, y, (1.12, 1.4), (1.38, 1.02)) < 0.07
    head = np.hypot(x - 1.2, y - 1.62) < 0.13
    keep = (wheel < 0.34) | frame | leg | torso | arm | head
    x, y, wheel = x[keep], y[keep], wheel[keep]
    cloth = sample(p["cloth"], x * 40 + p["off"][0], y * 40 + p["off"][1], 1) * _rgb(p["shirt"]) * 1.6
    col = np.where((y > 0.9)[:, None], cloth, _rgb(p["trousers"]))
    col = np.where((wheel < 0.34)[:, None] & (y < 0.7)[:, None], np.where((wheel < 0.06)[:, None], 0.6, 0.05), col)
    col = np.where(frame[keep][:, None] & (wheel >= 0.34)[:, None], _rgb(p["bike"]), col)
    col = np.where(head[keep][:, None], _rgb(p["skin"]), col)
    return keep, col.astype(np.float32), 0.0


def sh_car(s, t, z, pxm, pr):
    """Faces of a car (``part``: end, side, top, cabin_end, cabin_side, cargo_end, cargo_side)."""
    p, part = pr.params, pr.params["part"]
    x, y, w, h = s * pr.wm, t * pr.hm, pr.wm, pr.hm
    paint, keep = _rgb(p["paint"]), None
    shade = np.float32(p["shade"])
    if part in ("top", "cargo_top"):
        return None, np.broadcast_to(paint * shade * 1.1, (s.size, 3)).copy(), 0.0
    if part in ("cargo_end", "cargo_side"):
        d = np.where((x % 1.2) < 0.06, 0.8, 1.0) * np.where(y < 0.15, 0.3, 1.0)
        return None, _col(paint, d * shade * (0.85 + 0.15 * t)), 0.0
    if part == "cabin_end":
        keep = np.abs(s - 0.5) < 0.5 - 0.1 * t
        glass = (np.abs(s - 0.5) < 0.42 - 0.1 * t) & (t > 0.12) & (t < 0.88)
        col = np.where(glass[:, None], _rgb((0.07, 0.09, 0.12)) + 0.25 * t[:, None], paint * shade)
        return keep, col[keep].astype(np.float32), 0.0
    if part == "cabin_side":
        keep = (s > 0.28 * t) & (s < 1 - 0.18 * t)
        glass = (s > 0.28 * t + 0.06) & (s < 0.95 - 0.18 * t) & (t > 0.12) & (t < 0.85) & (np.abs(s - 0.52) > 0.03)
        col = np.where(glass[:, None], _rgb((0.07, 0.09, 0.12)) + 0.25 * t[:, None], paint * shade)
        return keep, col[keep].astype(np.float32), 0.0
    col = _col(paint, shade * (0.78 + 0.3 * t) * np.where(y < 0.28, 0.45, 1.0))
    if part == "end":
        lamp = (y > 0.55 * h) & (y < 0.85 * h) & (np.abs(x - w / 2) > 0.36 * w)
        col[lamp] = (0.95, 0.9, 0.75) if p["front"] else (0.75, 0.05, 0.04)
        plate = (np.abs(x - w / 2) < 0.25) & (y > 0.3) & (y < 0.45)
        col[plate] = 0.85
    else:
        wheel = np.minimum(np.hypot(x - 0.2 * w, y - 0.33), np.hypot(x - 0.8 * w, y - 0.33))
        col = np.where((wheel < 0.33)[:, None], np.where((wheel < 0.17)[:, None], 0.45, 0.04), col)
        col[np.abs(x - 0.5 * w) < 0.03] *= 0.5
    return None, col.astype(np.float32), 0.0


SHADERS = {"facade": sh_facade, "skyline": sh_skyline, "treeline": sh_treeline, "hedge": sh_hedge, "wall": sh_wall,
           "pole": sh_pole, "light": sh_light, "sign": sh_sign, "tree": sh_tree, "person": sh_person,
           "rider": sh_rider, "car": sh_car}


# ------------------------------------------------------------------------------------ ground, sky


@dataclass(frozen=True)
class CrossSection:
    """The road's lateral profile (m from the road centre, both sides alike): grass median, driving
    lanes, sidewalk, terrain verge, then ``outer`` ground (a class id) up to the horizon."""

    median: float
    lanes: int
    lane_width: float
    sidewalk: float
    verge: float
    outer: int
    classes: tuple[int, int, int]  # terrain, road, sidewalk class ids
    crosswalks: tuple[float, ...] = ()

    @property
    def road(self) -> float:
        return self.lanes * self.lane_width / 2

    def bounds(self) -> np.ndarray:
        m = self.median / 2
        return np.array([m, m + self.road, m + self.road + self.sidewalk, m + self.road + self.sidewalk + self.verge])


def _paint(dist, width, pxm) -> np.ndarray:
    """Anti-aliased coverage of a painted line of ``width`` m at distance ``dist`` m."""
    return np.clip((width / 2 - dist) / pxm + 0.5, 0.0, 1.0)


def draw_ground(cv: Canvas, view: View, xs: CrossSection, tints: dict, offs: np.ndarray) -> None:
    """Road, lane markings, crosswalks, sidewalk tiles and terrain for every pixel below the horizon."""
    i0 = max(math.floor(view.cy + 0.5), 0)
    if i0 >= view.height:
        return
    z = np.minimum(view.cam_h * view.f / (np.arange(i0, view.height) + 0.5 - view.cy), 5e3)[:, None]
    u = (np.arange(view.width) + 0.5 - view.cx)[None, :]
    x = u * z / view.f + view.cam_x - view.curv * z * z
    xa = np.abs(x)
    zone = np.searchsorted(xs.bounds(), xa, side="right")
    terrain, road, sidewalk = xs.classes
    lut = np.array([terrain, road, sidewalk, terrain, xs.outer], np.uint8)
    label = lut[zone]
    zz = np.broadcast_to(z, x.shape)
    pxm = zz / view.f
    lv = level(np.sqrt(pxm * zz * pxm / view.cam_h) * 48)
    rgb = np.empty(x.shape + (3,), np.float32)
    m = label == road
    xm, zm, pm, lm = x[m], zz[m], pxm[m], lv[m]
    col = _col(tints["road"], detail("gravel", xm * 48 + offs[0], zm * 48 + offs[1], lm, 0.25))
    xr = np.abs(xm) - xs.median / 2
    k = np.round(xr / xs.lane_width)
    dashed = (k > 0) & (k < xs.lanes / 2) & ((zm % 9.0) < 3.0)
    solid = (k == 0) & (xs.median == 0) & (xs.lanes >= 2)
    cover = _paint(np.abs(xr - k * xs.lane_width), 0.14, pm) * (dashed | solid) + _paint(np.abs(xr - xs.road + 0.35), 0.14, pm)
    for zc in xs.crosswalks:
        cover = cover + ((zm > zc) & (zm < zc + 3.5) & ((xm % 1.0) < 0.55)) * 0.9
    cover = np.minimum(cover, 1.0)[:, None]
    rgb[m] = col * (1 - cover) + _rgb((0.85, 0.85, 0.82)) * cover
    m = label == sidewalk
    xm, zm, pm, lm = x[m], zz[m], pxm[m], lv[m]
    col = _col(tints["sidewalk"], detail("gravel", xm * 48 + offs[2], zm * 48 + offs[3], lm, 0.3))
    grout = np.maximum(_paint(np.abs(xm / 0.6 - np.round(xm / 0.6)) * 0.6, 0.04, pm),
                       _paint(np.abs(zm / 0.6 - np.round(zm / 0.6)) * 0.6, 0.04, pm * zm / view.cam_h))
    curb = _paint(np.abs(np.abs(xm) - xs.median / 2 - xs.road - 0.12), 0.24, pm) * (xs.sidewalk > 0)
    rgb[m] = col * (1 - 0.3 * grout)[:, None] * (1 + 0.25 * curb)[:, None]
    m = label == terrain
    xm, zm, lm = x[m], zz[m], lv[m]
    d = detail("grass", xm * 48 + offs[4], zm * 48 + offs[5], lm, 0.6)
    dry = sample("clouds", xm * 4 + offs[6], zm * 4 + offs[7], 0)[:, None]
    rgb[m] = (_rgb(tints["grass"]) * (1 - dry) + _rgb(tints["dry"]) * dry) * d[:, None]
    cv.rgb[i0:], cv.label[i0:], cv.z[i0:] = rgb, label, zz


def draw_sky(cv: Canvas, view: View, top, horizon, clouds, cloudiness: float, offs, cls: int) -> None:
    """Sky gradient with clouds on a plane far above, for every pixel above the horizon (depth inf)."""
    i1 = min(max(math.floor(view.cy + 0.5), 0), view.height)
    if i1 == 0:
        return
    dv = np.maximum(view.cy - (np.arange(i1) + 0.5), 1e-3)[:, None]
    u = (np.arange(view.width) + 0.5 - view.cx)[None, :]
    c = sample("clouds", u / dv * 30 + offs[0], view.f / dv * 30 + offs[1], 0)
    g = np.clip(dv / max(view.cy, 1.0), 0, 1) ** 0.7
    c = np.clip((c - 0.45) / 0.3, 0, 1) * np.clip(dv / (0.2 * view.height), 0, 1) * cloudiness
    base = _rgb(horizon) * (1 - g[..., None]) + _rgb(top) * g[..., None]
    cv.rgb[:i1] = base * (1 - c[..., None]) + _rgb(clouds) * c[..., None]
    cv.label[:i1] = cls
    cv.z[:i1] = np.inf


def add_glows(rgb: np.ndarray, zbuf: np.ndarray, view: View, lights: np.ndarray, gain: float) -> None:
    """Add a Gaussian glow (additive, in place) for each light ``[X, Y, Z, radius m, r, g, b]`` whose
    centre is visible (not behind a nearer surface)."""
    if gain <= 0 or len(lights) == 0:
        return
    pts = np.stack([view.project(p) for p in lights[:, :3]])
    u, v, z = pts[:, 0], pts[:, 1], pts[:, 2]
    ok = (z > 0.5) & (u >= 0) & (u < view.width) & (v >= 0) & (v < view.height)
    lights, u, v, z = lights[ok], u[ok], v[ok], z[ok]
    ok = zbuf[v.astype(int), u.astype(int)] >= z - 0.8
    lights, u, v, z = lights[ok], u[ok], v[ok], z[ok]
    if len(lights) == 0:
        return
    r = np.maximum(lights[:, 3] * view.f / z, 0.7)[:, None]
    gy = np.exp(-(((np.arange(view.height) + 0.5)[None, :] - v[:, None]) / r) ** 2)
    gx = np.exp(-(((np.arange(view.width) + 0.5)[None, :] - u[:, None]) / r) ** 2)
    for c in range(3):
        rgb[..., c] += gain * ((gy * lights[:, 4 + c, None]).T @ gx)
