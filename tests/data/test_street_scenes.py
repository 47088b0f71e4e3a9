"""Synthetic driving scenes (fedsight.data.street_scenes): output contract, randomness contract (paired
domains), perspective geometry, occlusion, town statistics and appearance effects.

Checks are properties of the rendered scenes or independent references (a brute-force ray-plane
rasteriser, connected components, class histograms), never stored outputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import ndimage

from fedsight.data import street_scenes as ss
from fedsight.data.street_render import SHADERS, Canvas, Prim, View, draw_prims, draw_quad
from fedsight.data.street_scenes import CLASSES, TOWNS, Appearance, colorize, render_dataset, render_scene

CAR, ROAD, SKY, BUILDING, PERSON = (CLASSES.index(c) for c in ("car", "road", "sky", "building", "person"))
GROUND = [CLASSES.index(c) for c in ("road", "sidewalk", "terrain")]
WEATHERS, TIMES = ("clear", "rain", "fog"), ("day", "dusk", "night")
FEW = settings(max_examples=12, deadline=None)
appearances = st.builds(Appearance, st.sampled_from(WEATHERS), st.sampled_from(TIMES), st.sampled_from(("car", "bus")))


def luminance(img: np.ndarray) -> np.ndarray:
    return img.astype(np.float64) @ np.array([0.299, 0.587, 0.114])


# ------------------------------------------------------------------------------- output contract


def test_class_list_and_constants() -> None:
    assert CLASSES == ("road", "sidewalk", "building", "wall", "pole", "traffic light", "traffic sign", "vegetation",
                       "terrain", "sky", "person", "rider", "car")
    assert ss.IGNORE == 255 and len(ss.PALETTE) == len(CLASSES) and len(TOWNS) >= 6
    assert colorize(np.array([[0, 12, 255]], np.uint8)).tolist() == [[list(ss.PALETTE[0]), list(ss.PALETTE[12]), [0, 0, 0]]]


@FEW
@given(town=st.sampled_from(sorted(TOWNS)), app=appearances, h=st.integers(16, 72), w=st.integers(16, 140),
       seed=st.integers(0, 2**31 - 1), key=st.integers(0, 1000))
def test_shapes_dtypes_range_and_determinism(town, app, h, w, seed, key) -> None:
    img, lab = render_scene(town, app, h, w, seed, (key,))
    assert img.shape == (h, w, 3) and img.dtype == np.uint8
    assert lab.shape == (h, w) and lab.dtype == np.uint8
    assert lab.max() < len(CLASSES)
    img2, lab2 = render_scene(TOWNS[town], app, h, w, seed, (key,))  # a Town object renders as its name
    assert np.array_equal(img, img2) and np.array_equal(lab, lab2)


def test_different_keys_and_seeds_differ() -> None:
    base = render_scene("suburb", Appearance(), 48, 96, 3, (0,))
    for other in (render_scene("suburb", Appearance(), 48, 96, 3, (1,)), render_scene("suburb", Appearance(), 48, 96, 4, (0,))):
        assert not np.array_equal(base[1], other[1])
        assert not np.array_equal(base[0], other[0])


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="unknown town"):
        render_scene("atlantis", Appearance(), 16, 16, 0)
    for bad in ({"weather": "snow"}, {"time": "noon"}, {"camera": "drone"}):
        with pytest.raises(ValueError, match="unknown appearance"):
            Appearance(**bad)
    for bad in ({"outer": "water"}, {"lanes": 0}, {"materials": ("marble",)}, {"wall_styles": ("hedge",)}):
        with pytest.raises(ValueError):
            ss.Town(**{**TOWNS["suburb"].__dict__, **bad})


# -------------------------------------------------------------------------- randomness contract


@FEW
@given(town=st.sampled_from(sorted(TOWNS)), a=appearances, b=appearances, seed=st.integers(0, 2**31 - 1))
def test_paired_domains_share_labels_not_pixels(town, a, b, seed) -> None:
    b = Appearance(b.weather, b.time, a.camera)  # same camera: same projection of the same layout
    img_a, lab_a = render_scene(town, a, 40, 80, seed, (7, 1))
    img_b, lab_b = render_scene(town, b, 40, 80, seed, (7, 1))
    assert np.array_equal(lab_a, lab_b)
    if a != b:
        assert np.abs(img_a.astype(int) - img_b.astype(int)).mean() > 2.0


def test_camera_changes_geometry_consistently() -> None:
    car_top, bus_top = [], []
    for k in range(8):
        _, lab_car = render_scene("downtown", Appearance(camera="car"), 64, 128, 5, (k,))
        _, lab_bus = render_scene("downtown", Appearance(camera="bus"), 64, 128, 5, (k,))
        assert not np.array_equal(lab_car, lab_bus)
        car_top.append(np.flatnonzero(np.isin(lab_car, GROUND).any(1))[0])
        bus_top.append(np.flatnonzero(np.isin(lab_bus, GROUND).any(1))[0])
    assert np.median(bus_top) > np.median(car_top)  # the bus sees the horizon lower in the image


# ------------------------------------------------------------------------------------- geometry


@pytest.mark.parametrize("camera", ["car", "bus"])
def test_sky_above_horizon_ground_below(camera) -> None:
    for i, town in enumerate(TOWNS):
        for k in range(3):
            _, cv, view, _ = ss._render(town, Appearance("fog", "night", camera), 48, 96, 2, (i, k))
            rows = np.arange(48)[:, None] + 0.5 + np.zeros((1, 96))
            sky, road = cv.label == SKY, cv.label == ROAD
            assert sky.any() and road.any()
            assert (rows[sky] < view.cy).all() and (rows[np.isin(cv.label, GROUND)] > view.cy).all()
            assert rows[road].mean() > rows[sky].mean()


def test_road_follows_the_bend_and_the_camera_lane() -> None:
    """Row by row, the road's centre lies at the projection of X = curv Z**2 - cam_x (world bend, camera
    lane offset), Z = f cam_h / (v - cy); an empty rural road makes the road's edges visible."""
    empty = ss.Town(**{**TOWNS["rural"].__dict__, "cars": 0.0, "parked": 0.0, "persons": 0.0, "riders": 0.0, "pole_spacing": 1e4})
    bends = []
    for k in range(6):
        _, cv, view, _ = ss._render(empty, Appearance(), 96, 192, 13, (k,))
        bends.append(abs(view.curv))
        checked = 0
        for i in range(math.ceil(view.cy + 3), 96):
            cols = np.flatnonzero(cv.label[i] == ROAD)
            if len(cols) == 0 or cols[0] == 0 or cols[-1] == 191 or len(cols) != cols[-1] - cols[0] + 1:
                continue
            z = view.f * view.cam_h / (i + 0.5 - view.cy)
            expected = view.cx + view.f * (view.curv * z * z - view.cam_x) / z
            assert abs((cols[0] + cols[-1] + 1) / 2 - expected) < 1.0, (k, i)
            checked += 1
        assert checked > 5
    assert max(bends) > 0.001  # bent roads were among those checked


def _brute_force_mask(view: View, prim: Prim, eps: float) -> np.ndarray:
    """Reference: solve p00 + s A + t B = lambda d per pixel (3x3 linear systems) on the bent corners;
    inside when s and t lie in [-eps, 1 + eps]."""
    def cam(p):
        return np.array([p[0] + view.curv * p[2] ** 2 - view.cam_x, p[1] - view.cam_h, p[2]])

    p0, a, b = (np.asarray(v, float) for v in (prim.p0, prim.a, prim.b))
    P00 = cam(p0)
    A, B = cam(p0 + a) - P00, cam(p0 + b) - P00
    jj, ii = np.meshgrid(np.arange(view.width) + 0.5, np.arange(view.height) + 0.5)
    d = np.stack([(jj - view.cx) / view.f, -(ii - view.cy) / view.f, np.ones_like(jj)], -1)
    M = np.stack([np.broadcast_to(A, d.shape), np.broadcast_to(B, d.shape), -d], -1)
    parallel = np.abs(np.linalg.det(M)) < 1e-12  # rays parallel to the plane (or the camera in it) miss
    M[parallel] = np.eye(3)
    s, t, lam = np.moveaxis(np.linalg.solve(M, np.broadcast_to(-P00, d.shape)[..., None])[..., 0], -1, 0)
    return (s >= -eps) & (s <= 1 + eps) & (t >= -eps) & (t <= 1 + eps) & (lam > 0) & ~parallel


def _flat(s, t, z, pxm, prim):
    return None, np.ones((s.size, 3), np.float32), 0.0


@settings(max_examples=60, deadline=None)
@given(f=st.floats(40, 160), cy=st.floats(5, 55), cam_h=st.floats(1, 3.5), cam_x=st.floats(-3, 3),
       curv=st.floats(-0.002, 0.002), kind=st.sampled_from(("end", "side", "top")), x=st.floats(-15, 15), z=st.floats(2, 60),
       size=st.tuples(st.floats(0.3, 12), st.floats(0.3, 12)))
def test_rasteriser_matches_brute_force_ray_casting(f, cy, cam_h, cam_x, curv, kind, x, z, size) -> None:
    """The span rasteriser covers exactly the pixel centres whose rays hit the quad."""
    view = View(60, 120, f, cy, cam_h, cam_x, curv)
    w, h = size
    prim = {"end": Prim("q", 1, (x, 0.5, z), (w, 0, 0), (0, h, 0)), "side": Prim("q", 1, (x, 0, z), (0, 0, w), (0, h, 0)),
            "top": Prim("q", 1, (x, 1.0, z), (w, 0, 0), (0, 0, h))}[kind]
    cv = Canvas(60, 120)
    draw_quad(cv, view, prim, 0, _flat)
    seen = kind != "top" or 1.0 < cam_h  # tops are seen from above only
    got = cv.label == 1
    # equal up to pixel centres on the quad's border (ties within 1e-7 of an edge may go either way)
    assert not (got & ~(_brute_force_mask(view, prim, 1e-7) & seen)).any()
    assert not (~got & _brute_force_mask(view, prim, -1e-7) & seen).any()


def _fill_appearance(prims) -> None:
    for p in prims:
        p.params.update(off=(0.0, 0.0), seed=0.0, lit=0.0)


def test_painter_order_nearest_object_wins() -> None:
    """A facade, a car in front of it and a person in front of the car: each pixel shows the nearest
    surface covering it, in any list order, and the car's label region is exactly where it was drawn."""
    view = View(64, 128, 110.0, 26.0, 1.4, 0.0, 0.0)
    def scene():
        prims, lights = [], []
        ss._buildings(ss.Town(**{**TOWNS["downtown"].__dict__, "building_density": 1.0}), np.random.default_rng(0), 6.0, prims)
        facades = len(prims)
        ss._car(np.random.default_rng(1), TOWNS["downtown"], 3.5, 9.0, False, 0.0, prims, lights, False)
        clothes = {"stride": 0.2, "cloth": "coffee", "shirt": (0.5, 0.5, 0.5), "trousers": (0.1, 0.1, 0.1), "skin": (0.8, 0.6, 0.5),
                   "hair": (0.1, 0.1, 0.1)}
        prims.append(Prim("person", PERSON, (2.7, 0.0, 6.0), (0.6, 0, 0), (0, 1.7, 0), clothes))
        _fill_appearance(prims)
        return prims, facades

    prims, facades = scene()
    layers = {}
    for name, sel in (("facades", range(facades)), ("car", range(facades, len(prims) - 1)), ("person", [len(prims) - 1])):
        cv = Canvas(64, 128)
        draw_prims(cv, view, [prims[i] for i in sel], SHADERS)
        layers[name] = cv
    full = Canvas(64, 128)
    draw_prims(full, view, prims, SHADERS)
    reverse = Canvas(64, 128)
    draw_prims(reverse, view, prims[::-1], SHADERS)
    assert np.array_equal(full.label, reverse.label) and np.array_equal(full.rgb, reverse.rgb)
    car_alone, person_alone = layers["car"].label == CAR, layers["person"].label == PERSON
    assert car_alone.any() and person_alone.any() and (car_alone & person_alone).any()
    assert (layers["facades"].label[car_alone] == BUILDING).any()  # the car hides part of a facade
    assert np.array_equal(full.label == PERSON, person_alone)  # nearest: the person is complete
    assert np.array_equal(full.label == CAR, car_alone & ~person_alone)  # the car, minus what the person hides
    assert ndimage.label(car_alone)[1] == 1  # a car alone is one contiguous region ...
    assert np.flatnonzero(car_alone.any(1)).max() + 0.5 > view.cy  # ... standing on the ground below the horizon
    depth = np.minimum(np.minimum(layers["facades"].z, layers["car"].z), layers["person"].z)
    assert np.allclose(full.z, depth)  # the depth buffer holds the nearest surface everywhere


def test_cars_in_scenes_stand_on_the_ground() -> None:
    seen = 0
    for k in range(24):
        town = ("downtown", "boulevard", "suburb", "industrial")[k % 4]
        _, cv, view, _ = ss._render(town, Appearance(camera=("car", "bus")[k % 2]), 64, 128, 9, (k,))
        comps, n = ndimage.label(cv.label == CAR)
        for c in range(1, n + 1):
            rows = np.flatnonzero((comps == c).any(1))
            assert rows.max() + 0.5 > view.cy, "every car region reaches below the horizon"
        seen += n
    assert seen > 20


# ---------------------------------------------------------------------------------------- towns


@pytest.fixture(scope="module")
def town_histograms() -> dict[str, np.ndarray]:
    hists = {}
    for town in TOWNS:
        h = np.zeros(len(CLASSES))
        for k in range(20):
            _, lab = render_scene(town, Appearance(), 40, 80, 1, (k,))
            h += np.bincount(lab.ravel(), minlength=len(CLASSES))
        hists[town] = h / h.sum()
    return hists


def test_towns_have_their_character(town_histograms) -> None:
    h = {t: dict(zip(CLASSES, v)) for t, v in town_histograms.items()}
    assert h["rural"]["sidewalk"] == 0
    assert h["rural"]["vegetation"] + h["rural"]["terrain"] > 3 * (h["downtown"]["vegetation"] + h["downtown"]["terrain"]) + 0.1
    assert h["downtown"]["building"] > 5 * h["rural"]["building"]
    assert h["oldtown"]["building"] > h["suburb"]["building"] and h["oldtown"]["sky"] < h["rural"]["sky"]
    assert h["industrial"]["wall"] == max(h[t]["wall"] for t in h)
    assert h["boulevard"]["vegetation"] > h["downtown"]["vegetation"] + 0.1


def test_town_histograms_differ_pairwise(town_histograms) -> None:
    names = sorted(town_histograms)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            tv = 0.5 * np.abs(town_histograms[a] - town_histograms[b]).sum()
            assert tv > 0.1, (a, b, tv)


def test_docstring_town_table_matches_towns() -> None:
    cam_h, horizon, _ = ss.CAMERAS["car"]
    for name, t in TOWNS.items():
        row = next(line.split() for line in ss.__doc__.splitlines() if line.split()[:1] == [name])
        road = t.lanes * t.lane_width * (128 - 0.5 - horizon * 128) / (cam_h * 256)  # multiples of the bottom row
        assert row[1] == f"{t.lanes}x{t.lane_width:g}" and abs(float(row[2]) - road) < 0.01, name
        assert row[7] == f"{t.building_height[0]:g}-{t.building_height[1]:g}", name
        documented = [float(row[i]) for i in (3, 4, 5, 6, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18)]
        actual = [t.sidewalk, t.verge, t.median, t.building_density, t.wall_prob, t.hedge_prob, t.pole_spacing, t.p_light,
                  t.p_sign, t.cars, t.parked, t.truck_frac, t.persons, t.riders]
        assert documented == actual, name


def test_dataset_covers_every_class_and_matches_scenes() -> None:
    apps = [Appearance(), Appearance("fog", "night")]
    images, labels, ids, names = render_dataset(list(TOWNS), apps, 3, 48, 96, seed=2)
    n = len(TOWNS) * 2 * 3
    assert images.shape == (n, 48, 96, 3) and labels.shape == (n, 48, 96) and ids.dtype == np.int64
    assert names[:2] == [f"{next(iter(TOWNS))}/clear-day-car", f"{next(iter(TOWNS))}/fog-night-car"]
    assert np.array_equal(ids, np.repeat(np.arange(len(names)), 3))
    present = np.bincount(labels.ravel(), minlength=len(CLASSES))
    assert (present > 0).all(), [c for c, p in zip(CLASSES, present) if p == 0]
    img, lab = render_scene(list(TOWNS)[2], apps[1], 48, 96, 2, key=(5, 1))
    assert np.array_equal(images[5 * 3 + 1], img) and np.array_equal(labels[5 * 3 + 1], lab)


# ----------------------------------------------------------------------------------- appearances


def test_fog_fades_far_more_than_near() -> None:
    """Fog keeps near surfaces and fades far ones: contrast (luminance std) and colour change grow with
    depth, and the top half of the image (non-sky) loses more contrast than the bottom rows."""
    top_ratios, bottom_ratios = [], []
    for k, town in enumerate(TOWNS):
        clear, cv, _, _ = ss._render(town, Appearance(), 64, 128, 4, (k,))
        fog, lab = render_scene(town, Appearance("fog"), 64, 128, 4, (k,))
        lum_c, lum_f = luminance(clear), luminance(fog)
        far, near = np.isfinite(cv.z) & (cv.z > 30), cv.z < 8
        assert far.sum() > 50 and near.sum() > 50
        assert lum_f[far].std() / lum_c[far].std() < lum_f[near].std() / lum_c[near].std() - 0.2, town
        assert np.abs(fog.astype(int) - clear)[near].mean() < 0.5 * np.abs(fog.astype(int) - clear)[far].mean(), town
        top = (np.arange(64) < 32)[:, None] & (lab != SKY)
        top_ratios.append(lum_f[top].std() / lum_c[top].std())
        bottom_ratios.append(lum_f[-6:].std() / lum_c[-6:].std())
    assert np.mean(top_ratios) < np.mean(bottom_ratios) - 0.1


def test_rain_dusk_night_are_darker_than_clear_day() -> None:
    means = {}
    for app in (Appearance(), Appearance("rain"), Appearance(time="dusk"), Appearance(time="night"), Appearance("rain", "night")):
        means[app.name] = np.mean([luminance(render_scene(t, app, 40, 80, 6, (k,))[0]).mean() for k, t in enumerate(TOWNS)])
    day = means["clear-day-car"]
    assert means["rain-day-car"] < 0.9 * day
    assert means["clear-night-car"] < means["clear-dusk-car"] < 0.85 * day
    assert means["clear-night-car"] < 0.35 * day and means["rain-night-car"] < 0.35 * day


def test_night_sky_is_near_black_and_lights_glow() -> None:
    img, lab = render_scene("downtown", Appearance(time="night"), 64, 128, 8, (0,))
    day, _ = render_scene("downtown", Appearance(), 64, 128, 8, (0,))
    assert luminance(img)[lab == SKY].mean() < 20 < luminance(day)[lab == SKY].mean()
    assert (luminance(img)[lab != SKY] > 150).sum() > 3  # lamps, lit windows, head/tail lights


def test_rain_draws_bright_slanted_streaks() -> None:
    """Rain adds thin bright near-vertical lines: in the (smooth) sky, pixels brighter than both row
    neighbours appear only with rain, and they form components taller than wide."""
    def spikes(img, lab):
        lum = luminance(img)
        sky = (lab[:, 1:-1] == SKY) & (lab[:, :-2] == SKY) & (lab[:, 2:] == SKY)
        return ((lum[:, 1:-1] - np.maximum(lum[:, :-2], lum[:, 2:])) > 8) & sky

    heights, widths, clear_count = [], [], 0
    for k in range(3):
        lab = render_scene("rural", Appearance(), 64, 128, 3, (k,))[1]
        clear_count += spikes(render_scene("rural", Appearance(), 64, 128, 3, (k,))[0], lab).sum()
        comps, _ = ndimage.label(spikes(render_scene("rural", Appearance("rain"), 64, 128, 3, (k,))[0], lab), np.ones((3, 3)))
        for sl in ndimage.find_objects(comps):
            heights.append(sl[0].stop - sl[0].start)
            widths.append(sl[1].stop - sl[1].start)
    assert clear_count < 5 and len(heights) > 20
    assert np.mean(heights) > 3 and np.median(np.array(heights) / np.array(widths)) >= 1.5


def test_colour_classifier_loses_accuracy_under_domain_shift() -> None:
    """A nearest-class-mean pixel classifier on colour, fit on clear-day scenes, is less accurate on the
    same layouts under fog at night than on held-out clear-day scenes."""
    def pixels(app, keys):
        data = [render_scene("suburb", app, 40, 80, 12, (k,)) for k in keys]
        return np.concatenate([d[0].reshape(-1, 3) for d in data]).astype(float), np.concatenate([d[1].ravel() for d in data])

    x, y = pixels(Appearance(), range(4))
    classes = np.unique(y)
    means = np.stack([x[y == c].mean(0) for c in classes])

    def accuracy(app):
        xt, yt = pixels(app, range(4, 8))
        pred = classes[np.argmin(((xt[:, None, :] - means[None]) ** 2).sum(-1), 1)]
        return (pred == yt).mean()

    same, shifted = accuracy(Appearance()), accuracy(Appearance("fog", "night"))
    assert same > 0.4 and shifted < same - 0.15, (same, shifted)
