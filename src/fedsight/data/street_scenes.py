"""Synthetic driving scenes for federated semantic segmentation (a stand-in for FedDrive's Cityscapes and
IDDA, which cannot be downloaded here).

What is generated. A forward-looking camera on a straight or gently bending street, rendered in
perspective with a vanishing point on the horizon: road (asphalt, dashed lane lines, edge lines,
crosswalks), curbs and tiled sidewalks, terrain verges and fields, building facades (brick, plaster,
glass or corrugated metal, with window grids and shop fronts) along both sides whose screen height
scales with 1/depth, walls and fences, hedges, roadside and field trees, poles at regular intervals
carrying street lamps, traffic lights or traffic signs, moving and parked cars (and trucks, which are
labelled car), pedestrians on the sidewalks and crosswalks, riders (a person on a bicycle) on the road,
and the sky with clouds above the horizon, behind a far city skyline or tree line. Every object is a
textured planar quad in road-aligned world metres (``fedsight.data.street_render``): textures are
patches of the photographs shipped with scikit-image and scikit-learn (brick, grass, gravel, clothes
from the colour photos), tinted per object. Objects are drawn back to front (painter's algorithm) with a
depth test, so near objects occlude far ones identically in the image and the label map.

Classes (ids 0..12, Cityscapes train-id order restricted to these): road, sidewalk, building, wall
(walls and fences), pole, traffic light, traffic sign, vegetation, terrain, sky, person, rider (person
and bicycle), car (cars and trucks). Every pixel is labelled; ``IGNORE = 255`` exists for consumers.

Towns (:data:`TOWNS`). Lanes (count x width), sidewalk, verge (terrain strip beyond the sidewalk) and
median in metres; "road" is the road width in multiples of the bottom image row's width for the car
camera (>1: the road fills the bottom row); built = share of facade slots built; height in m; trees =
roadside spacing in m (+ mean field trees); walls and hedges = share of property-line segments; poles =
spacing in m; lights and signs = probability per pole; cars = mean moving cars per scene, parked = per
100 m of curb, trucks = share of cars; persons and riders = mean per scene:

========== ===== ==== ======== ===== ====== ===== ====== ====== ===== ====== ===== ====== ===== ==== ====== ====== ======= ======
town       lanes road sidewalk verge median built height trees  walls hedges poles lights signs cars parked trucks persons riders
========== ===== ==== ======== ===== ====== ===== ====== ====== ===== ====== ===== ====== ===== ==== ====== ====== ======= ======
downtown   4x3.3 2.72 4.5      0     0      0.95  18-50  -      0.05  0      15    0.5    0.5   5    5      0.1    9       1.5
suburb     2x3.2 1.32 2        3     0      0.75  5-9    14+1f  0.35  0.4    25    0.1    0.35  1.5  4      0.05   2       0.6
rural      2x3   1.23 0        9     0      0.06  4-7    18+7f  0.25  0.2    45    0      0.3   1    0      0.15   0.4     0.4
industrial 2x4   1.65 1.2      2     0      0.6   6-14   -+0.5f 0.8   0.05   30    0.1    0.4   2    3      0.5    0.6     0.2
oldtown    1x4.2 0.86 1.6      0     0      1     9-17   -      0.05  0      18    0.1    0.5   0.6  3      0      6       1.2
boulevard  6x3.4 4.20 5        2     3      0.85  12-26  8      0.1   0.3    20    0.6    0.4   6    3      0.1    3       1.5
========== ===== ==== ======== ===== ====== ===== ====== ====== ===== ====== ===== ====== ===== ==== ====== ====== ======= ======

Towns also differ in facade materials and palettes (glass and concrete downtown, pastel plaster in the
suburb, warm brick in the old town, grey metal in the industrial zone), far skyline or tree line,
hedges, traffic light and sign frequency, crosswalks, truck share and road curvature.

Appearances (:class:`Appearance`). ``camera`` changes geometry, hence image and labels together:
"car" is 1.4 m high with the horizon at 42 % of the image height and a 0.85 x width focal length; "bus"
is 3.0 m high, pitched so the horizon sits lower (49 %), with a wider view (0.75 x width): near ground
starts farther away and more of each facade is visible. ``weather`` and ``time`` change pixels only,
never labels: "rain" = overcast sky, darker (x0.72) and desaturated image, wet road mirroring the scene
above it, and thin bright slanted rain streaks; "fog" = blend towards a grey-white haze with weight
``1 - exp(-depth / D)`` (D 18-35 m; far objects fade, near ones stay, the sky is haze); "dusk" = warm
orange-purple sky, warm colour cast and lower brightness, dim lamps; "night" = near-black sky, dark
blue ambient light, the ego car's headlight cone on near surfaces, lit windows, glowing street lamps,
traffic lights and car head/tail lights. Sensor noise grows from day to night.

Randomness contract. :func:`render_scene` draws the layout (cross-section, camera lane and pitch,
bend, every object's position, size and colour) only from ``np_rng(seed, "street-layout", *key)`` and
the appearance noise (texture offsets, lit windows, clouds, rain streaks, fog distance, sensor noise)
only from ``np_rng(seed, "street-appearance", *key)``. So one seed and key rendered under two
appearances with the same camera gives identical label maps and different images (paired domains);
a different camera reprojects the same layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedsight.data.street_render import SHADERS, Canvas, CrossSection, Prim, View, add_glows, draw_ground, draw_prims, draw_sky
from fedsight.rng import np_rng

__all__ = ["CAMERAS", "CLASSES", "IGNORE", "PALETTE", "TOWNS", "Appearance", "Town", "colorize", "render_dataset", "render_scene"]

CLASSES: tuple[str, ...] = ("road", "sidewalk", "building", "wall", "pole", "traffic light", "traffic sign",
                            "vegetation", "terrain", "sky", "person", "rider", "car")
IGNORE = 255
ROAD, SIDEWALK, BUILDING, WALL, POLE, LIGHT, SIGN, VEGETATION, TERRAIN, SKY, PERSON, RIDER, CAR = range(13)
#: Cityscapes colours of the classes, for visualising label maps
PALETTE = np.array([(128, 64, 128), (244, 35, 232), (70, 70, 70), (102, 102, 156), (153, 153, 153), (250, 170, 30),
                    (220, 220, 0), (107, 142, 35), (152, 251, 152), (70, 130, 180), (220, 20, 60), (255, 0, 0),
                    (0, 0, 142)], np.uint8)
ZMAX, NEAR = 110.0, 1.0  # street objects between NEAR and ZMAX metres ahead


@dataclass(frozen=True)
class Town:
    """Layout statistics of one town (metres; probabilities in [0, 1]; "mean" counts are Poisson means)."""

    lanes: int  # driving lanes, both directions together (1: a narrow one-way street)
    lane_width: float
    sidewalk: float  # sidewalk width per side (0: no sidewalks)
    verge: float  # terrain strip between sidewalk and property line, per side
    outer: str  # ground beyond the verge: "terrain" or "sidewalk"
    median: float  # grass median between the directions (0: none)
    building_density: float  # share of facade slots along the street that are built
    building_height: tuple[float, float]
    building_length: tuple[float, float]
    setback: float  # facade distance behind the property line
    materials: tuple[str, ...]  # facade materials: brick, plaster, glass, metal
    palette: tuple[tuple[float, float, float], ...]  # facade tints
    skyline: float  # height of the far city skyline (0: none)
    treeline: float  # height of the far tree line (0: none)
    tree_spacing: float  # roadside (and median) tree spacing (0: none)
    field_trees: float  # mean trees scattered beyond the property line
    hedge_prob: float  # share of property-line segments with a hedge
    wall_prob: float  # share of property-line segments with a wall or fence
    wall_styles: tuple[str, ...]  # concrete, fence (wooden boards), mesh (chain-link)
    pole_spacing: float
    p_light: float  # probability a pole carries a traffic light
    p_sign: float  # probability a pole carries a traffic sign
    cars: float  # mean moving cars per scene
    parked: float  # mean parked cars per 100 m of curb (both sides together)
    truck_frac: float  # share of cars that are trucks
    persons: float  # mean pedestrians per scene
    riders: float  # mean riders per scene
    crosswalk_prob: float
    curvature: float  # maximal road bend (1/m; lateral offset curvature * Z**2)
    pitch: float  # horizon jitter, fraction of the image height

    def __post_init__(self) -> None:
        if self.lanes < 1 or self.outer not in ("terrain", "sidewalk") or not self.materials or not self.palette:
            raise ValueError("a town needs lanes >= 1, outer ground 'terrain' or 'sidewalk', materials and a palette")
        if not set(self.materials) <= {"brick", "plaster", "glass", "metal"} or not set(self.wall_styles) <= {"concrete", "fence", "mesh"}:
            raise ValueError(f"unknown facade material or wall style in {self.materials}, {self.wall_styles}")


_GREY = ((0.55, 0.56, 0.58), (0.62, 0.6, 0.56), (0.42, 0.45, 0.5), (0.45, 0.55, 0.62), (0.35, 0.42, 0.45))
TOWNS: dict[str, Town] = {
    "downtown": Town(
        lanes=4, lane_width=3.3, sidewalk=4.5, verge=0.0, outer="sidewalk", median=0.0,
        building_density=0.95, building_height=(18, 50), building_length=(10, 25), setback=0.0,
        materials=("glass", "plaster", "metal"), palette=_GREY, skyline=70.0, treeline=0.0,
        tree_spacing=0.0, field_trees=0.0, hedge_prob=0.0, wall_prob=0.05, wall_styles=("concrete",),
        pole_spacing=15.0, p_light=0.5, p_sign=0.5, cars=5.0, parked=5.0, truck_frac=0.1,
        persons=9.0, riders=1.5, crosswalk_prob=0.6, curvature=0.0005, pitch=0.02),
    "suburb": Town(
        lanes=2, lane_width=3.2, sidewalk=2.0, verge=3.0, outer="terrain", median=0.0,
        building_density=0.75, building_height=(5, 9), building_length=(9, 16), setback=4.0,
        materials=("plaster", "brick", "plaster"),
        palette=((0.9, 0.88, 0.8), (0.85, 0.8, 0.7), (0.75, 0.82, 0.86), (0.92, 0.85, 0.78), (0.8, 0.85, 0.75)),
        skyline=0.0, treeline=10.0, tree_spacing=14.0, field_trees=1.0, hedge_prob=0.4, wall_prob=0.35,
        wall_styles=("fence", "concrete"), pole_spacing=25.0, p_light=0.1, p_sign=0.35, cars=1.5, parked=4.0,
        truck_frac=0.05, persons=2.0, riders=0.6, crosswalk_prob=0.15, curvature=0.0012, pitch=0.03),
    "rural": Town(
        lanes=2, lane_width=3.0, sidewalk=0.0, verge=9.0, outer="terrain", median=0.0,
        building_density=0.06, building_height=(4, 7), building_length=(8, 14), setback=6.0,
        materials=("brick", "plaster"), palette=((0.75, 0.45, 0.35), (0.85, 0.8, 0.7)), skyline=0.0,
        treeline=14.0, tree_spacing=18.0, field_trees=7.0, hedge_prob=0.2, wall_prob=0.25, wall_styles=("fence",),
        pole_spacing=45.0, p_light=0.0, p_sign=0.3, cars=1.0, parked=0.0, truck_frac=0.15, persons=0.4,
        riders=0.4, crosswalk_prob=0.0, curvature=0.0016, pitch=0.04),
    "industrial": Town(
        lanes=2, lane_width=4.0, sidewalk=1.2, verge=2.0, outer="terrain", median=0.0,
        building_density=0.6, building_height=(6, 14), building_length=(20, 45), setback=6.0,
        materials=("metal", "plaster", "metal"),
        palette=((0.6, 0.62, 0.64), (0.5, 0.52, 0.55), (0.62, 0.45, 0.35), (0.7, 0.7, 0.66)), skyline=25.0,
        treeline=0.0, tree_spacing=0.0, field_trees=0.5, hedge_prob=0.05, wall_prob=0.8,
        wall_styles=("mesh", "concrete"), pole_spacing=30.0, p_light=0.1, p_sign=0.4, cars=2.0, parked=3.0,
        truck_frac=0.5, persons=0.6, riders=0.2, crosswalk_prob=0.05, curvature=0.0008, pitch=0.03),
    "oldtown": Town(
        lanes=1, lane_width=4.2, sidewalk=1.6, verge=0.0, outer="sidewalk", median=0.0,
        building_density=1.0, building_height=(9, 17), building_length=(6, 12), setback=0.0,
        materials=("brick", "plaster", "plaster"),
        palette=((0.82, 0.55, 0.4), (0.9, 0.75, 0.5), (0.8, 0.7, 0.6), (0.7, 0.45, 0.35), (0.92, 0.85, 0.65)),
        skyline=0.0, treeline=0.0, tree_spacing=0.0, field_trees=0.0, hedge_prob=0.0, wall_prob=0.05,
        wall_styles=("concrete",), pole_spacing=18.0, p_light=0.1, p_sign=0.5, cars=0.6, parked=3.0,
        truck_frac=0.0, persons=6.0, riders=1.2, crosswalk_prob=0.4, curvature=0.0014, pitch=0.03),
    "boulevard": Town(
        lanes=6, lane_width=3.4, sidewalk=5.0, verge=2.0, outer="sidewalk", median=3.0,
        building_density=0.85, building_height=(12, 26), building_length=(12, 22), setback=2.0,
        materials=("plaster", "brick", "glass"),
        palette=((0.9, 0.86, 0.78), (0.8, 0.78, 0.72), (0.72, 0.6, 0.5), (0.5, 0.6, 0.65)), skyline=40.0,
        treeline=0.0, tree_spacing=8.0, field_trees=0.0, hedge_prob=0.3, wall_prob=0.1, wall_styles=("concrete",),
        pole_spacing=20.0, p_light=0.6, p_sign=0.4, cars=6.0, parked=3.0, truck_frac=0.1, persons=3.0,
        riders=1.5, crosswalk_prob=0.3, curvature=0.0004, pitch=0.02),
}


@dataclass(frozen=True)
class Appearance:
    """How a layout is seen: weather (clear, rain, fog) and time (day, dusk, night) change pixels only;
    camera (car, bus) changes the projection of image and labels together."""

    weather: str = "clear"
    time: str = "day"
    camera: str = "car"

    def __post_init__(self) -> None:
        choices = ((self.weather, ("clear", "rain", "fog")), (self.time, ("day", "dusk", "night")), (self.camera, tuple(CAMERAS)))
        for value, allowed in choices:
            if value not in allowed:
                raise ValueError(f"unknown appearance {value!r}; choose from {allowed}")

    @property
    def name(self) -> str:
        return f"{self.weather}-{self.time}-{self.camera}"


#: camera height (m), horizon row (fraction of the image height), focal length (fraction of the width)
CAMERAS: dict[str, tuple[float, float, float]] = {"car": (1.4, 0.42, 0.85), "bus": (3.0, 0.49, 0.75)}


# ------------------------------------------------------------------------------------------ layout
_CAR_PAINT = ((0.92, 0.92, 0.92), (0.08, 0.08, 0.09), (0.6, 0.62, 0.64), (0.35, 0.36, 0.38), (0.65, 0.08, 0.07),
              (0.1, 0.2, 0.5), (0.12, 0.3, 0.18), (0.75, 0.7, 0.58), (0.85, 0.6, 0.1))
_CAR_P = np.array((0.22, 0.2, 0.18, 0.12, 0.08, 0.08, 0.04, 0.05, 0.03))
_CLOTH = ("astronaut", "chelsea", "coffee", "rocket", "china", "flower", "motorcycle", "colorwheel")
_SKIN = ((0.87, 0.7, 0.58), (0.72, 0.52, 0.4), (0.5, 0.34, 0.24), (0.3, 0.2, 0.14))
_WALL = {"concrete": ((0.8, 2.2), (0.62, 0.6, 0.57)), "fence": ((1.0, 1.8), (0.45, 0.33, 0.22)),  # heights, tint
         "mesh": ((1.8, 2.6), (0.5, 0.52, 0.5))}
_SIDEWALK = ((0.62, 0.6, 0.57), (0.7, 0.66, 0.6), (0.55, 0.55, 0.58), (0.68, 0.55, 0.5))
_LIGHT_RGB = ((1.0, 0.15, 0.05), (1.0, 0.7, 0.1), (0.2, 1.0, 0.45))


@dataclass
class _Layout:
    xs: CrossSection
    cam_x: float
    curv: float
    pitch: float
    tints: dict
    prims: list
    lights: list


def _side(kind, cls, x, z0, z1, y0, h, **params) -> Prim:  # vertical quad along the road (plane X = x)
    return Prim(kind, cls, (x, y0, z0), (0.0, 0.0, z1 - z0), (0.0, h, 0.0), params)


def _end(kind, cls, x0, x1, z, y0, h, **params) -> Prim:  # vertical quad facing the camera (plane Z = z)
    return Prim(kind, cls, (x0, y0, z), (x1 - x0, 0.0, 0.0), (0.0, h, 0.0), params)


def _top(kind, cls, x0, x1, z0, z1, y, **params) -> Prim:  # horizontal quad (plane Y = y)
    return Prim(kind, cls, (x0, y, z0), (x1 - x0, 0.0, 0.0), (0.0, 0.0, z1 - z0), params)


def _tint(rng, base, lo=0.85, hi=1.1) -> tuple:
    return tuple(float(c) for c in np.clip(np.asarray(base) * rng.uniform(lo, hi), 0, 1))


def _buildings(town: Town, rng, edge: float, out: list) -> None:
    for side in (-1, 1):
        z = rng.uniform(-15, 0)
        while z < ZMAX:
            length = rng.uniform(*town.building_length)
            if rng.random() < town.building_density:
                h, xf = rng.uniform(*town.building_height), side * (edge + town.setback + rng.uniform(0, 1.5))
                mat = town.materials[rng.integers(len(town.materials))]
                window = (0.45, 0.42) if mat == "glass" else (rng.uniform(0.15, 0.3), rng.uniform(0.18, 0.3))
                par = {"material": mat, "tint": _tint(rng, town.palette[rng.integers(len(town.palette))]), "window": window,
                       "floor": rng.uniform(3.0, 3.8), "bay": rng.uniform(2.2, 3.6), "shops": bool(rng.random() < 0.5),
                       "glass": _tint(rng, (0.9, 1.0, 1.1), 0.8, 1.2), "shade": 0.8 if side > 0 else 1.0}
                if z + length > max(z, NEAR) + 0.5:
                    out.append(_side("facade", BUILDING, xf, max(z, NEAR), z + length, 0.0, h, **par))
                if z >= NEAR:
                    out.append(_end("facade", BUILDING, xf, xf + side * 15.0, z, 0.0, h, **{**par, "shade": 0.88}))
            z += length + (rng.uniform(3, 12) if rng.random() < 0.25 else 0.0)


def _boundary(town: Town, rng, edge: float, out: list) -> None:
    """Walls, fences and hedges along the property line."""
    for side in (-1, 1):
        z = rng.uniform(-5, 5)
        while z < ZMAX:
            length, r = rng.uniform(6, 30), rng.random()
            z0, z1 = max(z, NEAR), z + length
            if r < town.wall_prob:
                style = town.wall_styles[rng.integers(len(town.wall_styles))]
                (lo, hi), tint = _WALL[style]
                h, tint = rng.uniform(lo, hi), _tint(rng, tint)
                if z1 > z0 + 0.5:
                    shade = 0.8 if side > 0 else 1.0
                    out.append(_side("wall", WALL, side * (edge - 0.3), z0, z1, 0.0, h, style=style, tint=tint, shade=shade))
            elif r < town.wall_prob + town.hedge_prob:
                h, tint, phase = rng.uniform(0.8, 1.6), _tint(rng, (0.2, 0.36, 0.12), 0.8, 1.2), rng.uniform(0, 6.3)
                if z1 > z0 + 0.5:
                    out.append(_side("hedge", VEGETATION, side * (edge - 0.6), z0, z1, 0.0, h, tint=tint, phase=phase))
            z += length + rng.uniform(0, 6)


def _tree(rng, x: float, z: float, out: list) -> None:
    h = rng.uniform(5, 11)
    w, crown_y = rng.uniform(0.45, 0.65) * h, rng.uniform(0.6, 0.7)
    tint, soff = _tint(rng, (0.22, 0.36, 0.12), 0.75, 1.25), tuple(rng.uniform(0, 256, 2))
    if z > NEAR + 0.5:
        out.append(_end("tree", VEGETATION, x - w / 2, x + w / 2, z, 0.0, h, crown_y=crown_y, tint=tint, soff=soff))


def _trees(town: Town, rng, xs: CrossSection, edge: float, out: list) -> None:
    inner = xs.median / 2 + xs.road
    if town.tree_spacing > 0:
        if xs.sidewalk >= 2.5:
            x_row = inner + 1.2
        elif xs.verge >= 1.5:
            x_row = inner + xs.sidewalk + xs.verge / 2
        else:
            x_row = edge + 1.5
        rows = (-x_row, x_row, 0.0) if xs.median >= 2 else (-x_row, x_row)
        for x in rows:
            z = rng.uniform(0, town.tree_spacing)
            while z < ZMAX:
                if rng.random() < 0.85:
                    _tree(rng, x + rng.uniform(-0.2, 0.2), z, out)
                z += town.tree_spacing * rng.uniform(0.8, 1.2)
    for _ in range(rng.poisson(town.field_trees)):
        _tree(rng, rng.choice((-1, 1)) * (edge + rng.uniform(1, 30)), rng.uniform(4, ZMAX), out)


def _poles(town: Town, rng, xs: CrossSection, out: list, lights: list) -> None:
    inner, urban = xs.median / 2 + xs.road, xs.sidewalk > 0
    tint = (0.45, 0.46, 0.48) if urban else (0.42, 0.32, 0.22)
    z = rng.uniform(3, town.pole_spacing)
    while z < ZMAX:
        side = 1 if rng.random() < 0.6 else -1
        x = side * (inner + (0.45 if urban else 1.3))
        r_light, r_sign = rng.random(), rng.random()
        if r_light < town.p_light:
            h, state = rng.uniform(4.2, 5.5), int(rng.integers(3))
            out.append(_end("light", LIGHT, x - 0.2, x + 0.2, z - 0.15, h - 1.1, 1.0, state=state))
            lights.append((x, h - 1.1 + (0.8, 0.5, 0.2)[state], z - 0.2, 0.35, *_LIGHT_RGB[state]))
        else:
            h = rng.uniform(6.5, 9.0)
            if urban:
                out.append(_end("pole", POLE, x, x - side * 1.6, z, h - 0.18, 0.18, tint=tint))
                lights.append((x - side * 1.5, h - 0.3, z, 0.6, 1.0, 0.85, 0.6))
        out.append(_end("pole", POLE, x - 0.11, x + 0.11, z, 0.0, h, tint=tint))
        if r_sign < town.p_sign:
            shape = ("circle", "triangle", "square", "rect")[rng.integers(4)]
            w, hh = (1.1, 0.6) if shape == "rect" else (0.65, 0.65)
            out.append(_end("sign", SIGN, x - w / 2, x + w / 2, z - 0.1, rng.uniform(2.0, 2.8), hh, shape=shape, shade=1.0))
        z += town.pole_spacing * rng.uniform(0.8, 1.2)


def _box(out, x0, x1, z0, z1, y0, y1, side_x, paint, front, parts) -> None:
    """The camera-facing faces of a box: near end, the side at ``side_x`` and the top."""
    end, side, top = parts
    shade = 0.78 if side_x == min(x0, x1) else 0.95
    out.append(_end("car", CAR, x0, x1, z0, y0, y1 - y0, part=end, paint=paint, front=front, shade=0.9))
    out.append(_side("car", CAR, side_x, z0, z1, y0, y1 - y0, part=side, paint=paint, front=front, shade=shade))
    out.append(_top("car", CAR, x0, x1, z0, z1, y1, part=top, paint=paint, front=front, shade=1.0))


def _car(rng, town: Town, x: float, z: float, front: bool, cam_x: float, out: list, lights: list, truck: bool) -> None:
    if truck:
        w, l, h = 2.45, rng.uniform(7, 10), rng.uniform(3.0, 3.6)
    else:
        w, l, h = rng.uniform(1.7, 1.95), rng.uniform(3.9, 4.8), rng.uniform(1.4, 1.6)
    paint = _tint(rng, _CAR_PAINT[rng.choice(len(_CAR_PAINT), p=_CAR_P)], 0.9, 1.05)
    x0, x1 = x - w / 2, x + w / 2
    sx = x0 if x > cam_x else x1
    if truck:
        cargo = _tint(rng, ((0.9, 0.9, 0.88), (0.7, 0.72, 0.75), (0.2, 0.3, 0.6))[rng.integers(3)], 0.9, 1.05)
        cab, box = ((z, z + 2.2), (z + 2.4, z + l)) if front else ((z + l - 2.2, z + l), (z, z + l - 2.4))
        _box(out, x0, x1, *box, 0.3, h, sx, cargo, front, ("cargo_end", "cargo_side", "cargo_top"))
        _box(out, x0, x1, *cab, 0.0, 0.5 * h, sx, paint, front, ("end", "side", "top"))
        _box(out, x0 + 0.05, x1 - 0.05, cab[0] + 0.1, cab[1], 0.5 * h, 0.8 * h, sx, paint, front, ("cabin_end", "cabin_side", "top"))
        hb = 0.5 * h
    else:
        hb, c = h * rng.uniform(0.5, 0.58), 0.06 * w
        cz = (z + 0.2 * l, z + 0.7 * l) if front else (z + 0.3 * l, z + 0.8 * l)
        _box(out, x0, x1, z, z + l, 0.0, hb, sx, paint, front, ("end", "side", "top"))
        _box(out, x0 + c, x1 - c, *cz, hb, h, sx + (c if sx == x0 else -c), paint, front, ("cabin_end", "cabin_side", "top"))
    rgb, r = ((1.0, 0.95, 0.8), 0.35) if front else ((0.95, 0.1, 0.05), 0.22)
    lights += [(x0 + 0.25, 0.7 * hb, z - 0.05, r, *rgb), (x1 - 0.25, 0.7 * hb, z - 0.05, r, *rgb)]


def _traffic(town: Town, rng, xs: CrossSection, cam_x: float, out: list, lights: list) -> None:
    """Moving cars in the lanes (left lanes oncoming), parked cars along both curbs."""
    m, placed = xs.median / 2, []

    def place(x, z, length) -> bool:
        if abs(x - cam_x) < 1.8 and z < 9.0:
            return False
        if any(abs(x - px) < 2.3 and z < pz1 + 1.5 and z + length > pz0 - 1.5 for px, pz0, pz1 in placed):
            return False
        placed.append((x, z, z + length))
        return True

    right = (xs.lanes + 1) // 2
    for _ in range(rng.poisson(town.cars)):
        k, truck = int(rng.integers(max(xs.lanes, 1))), bool(rng.random() < town.truck_frac)
        z, jitter = rng.uniform(6, 85), rng.uniform(-0.3, 0.3)
        if xs.lanes == 1:
            x, front = jitter, bool(rng.random() < 0.3)
        else:
            front = k >= right
            x = (-1 if front else 1) * (m + ((k - right if front else k) + 0.5) * xs.lane_width) + jitter
        if place(x, z, 10.0 if truck else 5.0):
            _car(rng, town, x, z, front, cam_x, out, lights, truck)
    for _ in range(rng.poisson(town.parked * ZMAX / 100)):
        side, z = rng.choice((-1, 1)), rng.uniform(2, ZMAX)
        x = side * (m + xs.road - 1.1)
        if place(x, z, 5.0):
            _car(rng, town, x, z, side < 0, cam_x, out, lights, False)


def _people(town: Town, rng, xs: CrossSection, out: list) -> None:
    inner = xs.median / 2 + xs.road
    for _ in range(rng.poisson(town.persons)):
        side, z = rng.choice((-1, 1)), rng.uniform(3, 60)
        if xs.crosswalks and rng.random() < 0.3:
            x, z = rng.uniform(-inner, inner), xs.crosswalks[rng.integers(len(xs.crosswalks))] + rng.uniform(0.5, 3.0)
        elif xs.sidewalk > 0.8:
            x = side * (inner + rng.uniform(0.4, xs.sidewalk - 0.3))
        else:
            x = side * (inner + xs.sidewalk + rng.uniform(0.3, 1.5))
        h = rng.uniform(1.55, 1.9)
        out.append(_end("person", PERSON, x - 0.18 * h, x + 0.18 * h, z, 0.0, h, stride=rng.uniform(0, 0.5), **_clothes(rng)))
    for _ in range(rng.poisson(town.riders)):
        side, z, flip = rng.choice((-1, 1)), rng.uniform(5, 60), bool(rng.random() < 0.5)
        x = side * (inner - rng.uniform(0.5, 1.1))
        bike = _tint(rng, _CAR_PAINT[rng.integers(len(_CAR_PAINT))])
        out.append(_end("rider", RIDER, x - 0.9, x + 0.9, z, 0.0, 1.8, flip=flip, bike=bike, **_clothes(rng)))


def _clothes(rng) -> dict:
    return {"cloth": _CLOTH[rng.integers(len(_CLOTH))], "shirt": _tint(rng, rng.uniform(0.2, 1.0, 3), 0.9, 1.1),
            "trousers": _tint(rng, rng.uniform(0.05, 0.4, 3)), "skin": _SKIN[rng.integers(len(_SKIN))],
            "hair": _tint(rng, (0.12, 0.08, 0.05), 0.5, 3.0)}


def _layout(town: Town, rng: np.random.Generator) -> _Layout:
    """World layout of one scene, drawn only from ``rng``."""
    lanes = town.lanes
    lane_w, sidewalk, verge = (v * rng.uniform(0.9, 1.1) for v in (town.lane_width, town.sidewalk, town.verge))
    crosswalks = (rng.uniform(8, 35),) if rng.random() < town.crosswalk_prob else ()
    xs = CrossSection(town.median, lanes, lane_w, sidewalk, verge, SIDEWALK if town.outer == "sidewalk" else TERRAIN,
                      (TERRAIN, ROAD, SIDEWALK), crosswalks)
    cam_x = town.median / 2 + (rng.integers((lanes + 1) // 2) + 0.5) * lane_w if lanes >= 2 else 0.0
    curv, pitch = rng.uniform(-1, 1) * town.curvature, rng.uniform(-1, 1) * town.pitch
    tints = {"road": _tint(rng, (0.33, 0.33, 0.35), 0.8, 1.15), "sidewalk": _tint(rng, _SIDEWALK[rng.integers(len(_SIDEWALK))]),
             "grass": _tint(rng, (0.3, 0.42, 0.16), 0.8, 1.15), "dry": _tint(rng, (0.52, 0.46, 0.3), 0.8, 1.15)}
    prims, lights = [], []
    edge = float(xs.bounds()[-1])
    if town.skyline > 0:
        zs, h = 500.0, town.skyline * rng.uniform(0.7, 1.2)  # far backdrops are centred on the view (unbent)
        prims.append(_end("skyline", BUILDING, -900 - curv * zs * zs, 900 - curv * zs * zs, zs, 0.0, h,
                          bin=rng.uniform(15, 30), gaps=0.2, hseed=rng.uniform(0, 100), tint=_tint(rng, (0.5, 0.53, 0.6))))
    if town.treeline > 0:
        zt = 220.0
        h = town.treeline * rng.uniform(0.7, 1.3)
        prims.append(_end("treeline", VEGETATION, -600 - curv * zt * zt, 600 - curv * zt * zt, zt, 0.0, h,
                          phase=tuple(rng.uniform(0, 6.3, 2)), tint=_tint(rng, (0.18, 0.27, 0.11))))
    _buildings(town, rng, edge, prims)
    _boundary(town, rng, edge, prims)
    _trees(town, rng, xs, edge, prims)
    _poles(town, rng, xs, prims, lights)
    _traffic(town, rng, xs, cam_x, prims, lights)
    _people(town, rng, xs, prims)
    return _Layout(xs, float(cam_x), float(curv), float(pitch), tints, prims, lights)


# ---------------------------------------------------------------------------------------- render
_SKY = {"day": ((0.28, 0.48, 0.82), (0.7, 0.8, 0.92), (0.96, 0.96, 0.97)),  # top, horizon, clouds
        "dusk": ((0.2, 0.17, 0.4), (0.98, 0.58, 0.3), (0.9, 0.55, 0.5)),
        "night": ((0.005, 0.005, 0.02), (0.035, 0.035, 0.06), (0.04, 0.04, 0.06))}
_AMBIENT = {"day": (1.0, 1.0, 1.0), "dusk": (0.64, 0.5, 0.38), "night": (0.09, 0.1, 0.14)}
_HAZE = {"day": (0.8, 0.81, 0.82), "dusk": (0.62, 0.52, 0.46), "night": (0.07, 0.07, 0.09)}
_NOISE = {"day": 0.008, "dusk": 0.015, "night": 0.025}


def _view(appearance: Appearance, lay: _Layout, height: int, width: int) -> View:
    cam_h, horizon, focal = CAMERAS[appearance.camera]
    return View(height, width, focal * width, height * (horizon + lay.pitch), cam_h, lay.cam_x, lay.curv)


def _sky(cv: Canvas, view: View, app: Appearance, rng) -> None:
    top, horizon, clouds = (np.asarray(c) for c in _SKY[app.time])
    cloudiness = rng.uniform(0.3, 1.0)
    if app.weather == "rain":  # overcast
        grey = np.float64(np.mean(_AMBIENT[app.time])) * 0.62
        top, horizon, clouds, cloudiness = 0.2 * top + 0.8 * grey, 0.2 * horizon + 0.9 * grey, clouds * 0.7, 1.0
    draw_sky(cv, view, top, horizon, clouds, cloudiness, rng.uniform(0, 256, 2), SKY)


def _rain_streaks(rgb: np.ndarray, rng, brightness: float) -> None:
    h, w = rgb.shape[:2]
    n = max(h * w // 220, 1)
    length = rng.uniform(0.04, 0.12, n) * h
    slant = rng.uniform(-0.35, 0.35) + rng.uniform(-0.04, 0.04, n)
    x0, y0 = rng.uniform(0, w, n), rng.uniform(-0.1 * h, h, n)
    steps = np.arange(math.ceil(length.max()) + 1) / (math.ceil(length.max()) + 1)
    ys = y0[:, None] + length[:, None] * steps
    xs = x0[:, None] + (slant * length)[:, None] * steps
    ok = (xs >= 0) & (xs < w) & (ys >= 0) & (ys < h) & (steps[None, :] * (math.ceil(length.max()) + 1) < length[:, None])
    flat = ys[ok].astype(np.int64) * w + xs[ok].astype(np.int64)
    px = rgb.reshape(-1, 3)
    px[flat] = px[flat] * 0.55 + 0.45 * brightness


def _appear(cv: Canvas, view: View, lay: _Layout, app: Appearance, rng) -> np.ndarray:
    """Time of day, weather and sensor noise on the rendered albedo; returns uint8 RGB."""
    rgb, solid = cv.rgb, np.isfinite(cv.z)[..., None]
    if app.time != "day":
        lit = rgb * np.asarray(_AMBIENT[app.time], np.float32)
        if app.time == "night":  # the ego car's headlights light near surfaces in a cone ahead
            a = (np.arange(view.width) + 0.5 - view.cx) / view.f
            below = (np.arange(view.height) > view.cy)[:, None]
            cone = np.exp(-((a / 0.3) ** 2))[None, :] * np.exp(-np.minimum(cv.z, 1e3) / 12.0) * below
            lit += rgb * (0.9 * cone[..., None]).astype(np.float32)
        lit += cv.emit[..., None] * np.asarray((0.95, 0.75, 0.45), np.float32) * (0.9 if app.time == "night" else 0.2)
        rgb = np.where(solid, lit, rgb)
        add_glows(rgb, cv.z, view, np.asarray(lay.lights, np.float64).reshape(-1, 7), 1.0 if app.time == "night" else 0.3)
    if app.weather == "rain":
        rows = np.clip(np.floor(2 * view.cy - np.arange(view.height) - 1).astype(np.int64), 0, view.height - 1)
        wet = (cv.label == ROAD)[..., None]
        rgb = np.where(wet, rgb * 0.6 + 0.35 * rgb[rows], rgb)
        grey = rgb.mean(-1, keepdims=True)
        rgb = (grey + 0.5 * (rgb - grey)) * 0.72
        _rain_streaks(rgb, rng, 0.25 + 0.6 * float(np.mean(_AMBIENT[app.time])))
    if app.weather == "fog":
        weight = (1.0 - np.exp(-cv.z / rng.uniform(18, 35)))[..., None]
        rgb = rgb * (1 - weight) + np.asarray(_HAZE[app.time], np.float32) * weight
    rgb = rgb + rng.standard_normal(rgb.shape, dtype=np.float32) * _NOISE[app.time]
    return np.clip(rgb * 255 + 0.5, 0, 255).astype(np.uint8)


def _render(town: Town | str, appearance: Appearance, height: int, width: int, seed: int, key: tuple = ()):
    """Render one scene; returns (uint8 image, canvas with labels, depth and object ids, view, layout)."""
    town = TOWNS[town] if isinstance(town, str) else town
    lay = _layout(town, np_rng(seed, "street-layout", *key))
    rng = np_rng(seed, "street-appearance", *key)
    view = _view(appearance, lay, height, width)
    cv = Canvas(height, width)
    _sky(cv, view, appearance, rng)
    draw_ground(cv, view, lay.xs, lay.tints, rng.uniform(0, 256, 8))
    extra = rng.random((len(lay.prims), 4))
    for prim, e in zip(lay.prims, extra):
        prim.params.update(off=(e[0] * 256, e[1] * 256), seed=e[2] * 100, lit=0.1 + 0.4 * e[3])
    draw_prims(cv, view, lay.prims, SHADERS)
    return _appear(cv, view, lay, appearance, rng), cv, view, lay


def render_scene(
    town: Town | str, appearance: Appearance, height: int, width: int, seed: int, key: tuple = ()
) -> tuple[np.ndarray, np.ndarray]:
    """One scene: RGB image uint8 ``[height, width, 3]`` and label map uint8 ``[height, width]`` (ids
    into :data:`CLASSES`). The layout depends only on ``(town, seed, key)`` and the camera, the pixels also
    on weather, time and ``np_rng(seed, "street-appearance", *key)`` (module docstring)."""
    if isinstance(town, str) and town not in TOWNS:
        raise ValueError(f"unknown town {town!r}; choose from {', '.join(TOWNS)}")
    image, cv, _, _ = _render(town, appearance, height, width, seed, key)
    return image, cv.label


def render_dataset(towns, appearances, per_domain: int, height: int, width: int, seed: int):
    """Scenes of every (town, appearance) domain, ``per_domain`` each, scene key ``(domain, index)``.

    Returns images uint8 ``[N, H, W, 3]``, labels uint8 ``[N, H, W]``, domain ids int64 ``[N]`` and the
    domain names ``"town/weather-time-camera"`` (towns given as :class:`Town` are named ``town<i>``)."""
    towns, appearances = list(towns), list(appearances)
    domains = [(t, a) for t in towns for a in appearances]
    n = len(domains) * per_domain
    images = np.empty((n, height, width, 3), np.uint8)
    labels = np.empty((n, height, width), np.uint8)
    ids = np.repeat(np.arange(len(domains), dtype=np.int64), per_domain)
    for d, (town, app) in enumerate(domains):
        for i in range(per_domain):
            images[d * per_domain + i], labels[d * per_domain + i] = render_scene(town, app, height, width, seed, key=(d, i))
    names = [f"{t if isinstance(t, str) else f'town{towns.index(t)}'}/{a.name}" for t, a in domains]
    return images, labels, ids, names


def colorize(labels: np.ndarray) -> np.ndarray:
    """Label map(s) as Cityscapes colours (uint8 ``[..., 3]``; IGNORE and unknown ids black)."""
    lut = np.zeros((256, 3), np.uint8)
    lut[: len(PALETTE)] = PALETTE
    return lut[labels]
