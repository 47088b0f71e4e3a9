"""Pose and skeleton geometry of the articulated figures of ``fedsight.data.figures``: body proportions,
joint-angle limits, the random pose / body build / view of a figure, and the 3-D joints they give.

Joints in MPII order (``R_ANKLE`` .. ``L_WRIST`` below; ``fedsight.data.keypoints.MPII16``). The skeleton is
built in body axes (x towards the figure's left, y up, z forward; unit = the standing height
``H``, origin = the pelvis), then turned by the view into camera axes (x right, y up, z towards the camera);
projection is orthographic (drop z).

Body proportions (fractions of the standing height ``H``; :data:`SEGMENTS`): thigh 0.245, shin 0.246,
upper arm 0.186, forearm 0.146, pelvis-thorax 0.288 and thorax-upper neck 0.052 (Winter, *Biomechanics and
Motor Control of Human Movement*, segment-length diagram: hip 0.530 H, knee 0.285 H, ankle 0.039 H,
shoulder 0.818 H, elbow 0.630 H, wrist 0.485 H, chin 0.870 H), head (upper neck to crown) 0.130 H,
shoulder joints 0.23 H apart (Winter's shoulder breadth 0.259 H less the deltoids) and hip joints 0.12 H
apart (a hip breadth of 0.191 H holds joint centres about 0.1 H apart; MPII annotators mark hips a little
wider). Every figure scales each length by its own factor in ``1 +- SEGMENT_VARIATION`` (8 %, same on both
sides) and each breadth by one in ``1 +- WIDTH_VARIATION`` (12 %); flesh radii by a build factor
0.85-1.2. Lengths in the image are projections of these, so never longer.

Pose (degrees, :data:`ANGLE_LIMITS`, clipped to normal active ranges of motion as tabulated by the
American Academy of Orthopaedic Surgeons, approximately): hip flexion -30..120 (extension negative),
abduction -20..45, rotation -40..45; knee flexion 0..135 (bends backwards only); ankle -20..45; shoulder
flexion -50..170, abduction -10..170, rotation -60..80; elbow flexion 0..145 (bends forwards only);
trunk flexion -20..60, lateral bend -25..25, twist -35..35; neck flexion -40..45, lateral bend -30..30,
head turn -70..70. A pose is drawn from one of five archetypes (stand 30 %, walk/run 30 %, arms raised
15 %, crouch/sit 10 %, free: uniform within the limits 15 %), then mirrored left/right with probability
1/2. View: yaw uniform in -60..60 (faces the camera) or, with probability ``free_view`` (0.25), over the
whole circle (profiles and back views); camera pitch -15..15; in-plane rotation ``N(0, 7)`` clipped to
+-20.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "ANGLE_LIMITS",
    "SEGMENTS",
    "SEGMENT_VARIATION",
    "WIDTH_VARIATION",
]

# joint indices (MPII order)
R_ANKLE, R_KNEE, R_HIP, L_HIP, L_KNEE, L_ANKLE, PELVIS, THORAX, UPPER_NECK, HEAD_TOP = range(10)
R_WRIST, R_ELBOW, R_SHOULDER, L_SHOULDER, L_ELBOW, L_WRIST = range(10, 16)

#: segment -> (joint pairs it spans, nominal length as a fraction of the standing height H); each figure
#: multiplies the nominal length by its own factor within ``1 +- SEGMENT_VARIATION`` (widths:
#: ``WIDTH_VARIATION``)
SEGMENTS: dict[str, tuple[tuple[tuple[int, int], ...], float]] = {
    "thigh": (((R_HIP, R_KNEE), (L_HIP, L_KNEE)), 0.245),
    "shin": (((R_KNEE, R_ANKLE), (L_KNEE, L_ANKLE)), 0.246),
    "upper_arm": (((R_SHOULDER, R_ELBOW), (L_SHOULDER, L_ELBOW)), 0.186),
    "forearm": (((R_ELBOW, R_WRIST), (L_ELBOW, L_WRIST)), 0.146),
    "trunk": (((PELVIS, THORAX),), 0.288),
    "neck": (((THORAX, UPPER_NECK),), 0.052),
    "head": (((UPPER_NECK, HEAD_TOP),), 0.130),
    "shoulder_width": (((R_SHOULDER, L_SHOULDER),), 0.23),
    "hip_width": (((R_HIP, L_HIP),), 0.12),
}
SEGMENT_VARIATION = 0.08
WIDTH_VARIATION = 0.12
_WIDTHS = ("shoulder_width", "hip_width")

#: joint-angle limits in degrees (normal active ranges of motion, AAOS, approximately)
ANGLE_LIMITS: dict[str, tuple[float, float]] = {
    "hip_flex": (-30, 120), "hip_abd": (-20, 45), "hip_rot": (-40, 45), "knee": (0, 135), "ankle": (-20, 45),
    "sh_flex": (-50, 170), "sh_abd": (-10, 170), "sh_rot": (-60, 80), "elbow": (0, 145),
    "trunk_flex": (-20, 60), "trunk_lat": (-25, 25), "trunk_twist": (-35, 35),
    "neck_flex": (-40, 45), "neck_lat": (-30, 30), "head_turn": (-70, 70),
}
_PAIRED = ("hip_flex", "hip_abd", "hip_rot", "knee", "ankle", "sh_flex", "sh_abd", "sh_rot", "elbow")

# torso and head dimensions (fractions of H)
_HEAD_HALF_WIDTH = 0.058
_TORSO_FLESH = (0.04, 0.06)  # beyond the shoulder / hip joints, each side
_TORSO_DEPTH = 0.055  # half the chest / pelvis depth


# ------------------------------------------------------------------------------------------- rotations


def _rx(a: float) -> np.ndarray:
    c, s = math.cos(a), math.sin(a)
    return np.array([[1, 0, 0], [0, c, -s], [0, s, c]])


def _ry(a: float) -> np.ndarray:
    c, s = math.cos(a), math.sin(a)
    return np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]])


def _rz(a: float) -> np.ndarray:
    c, s = math.cos(a), math.sin(a)
    return np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]])


_DOWN, _UP, _FWD, _LEFT = np.array([0.0, -1, 0]), np.array([0.0, 1, 0]), np.array([0.0, 0, 1]), np.array([1.0, 0, 0])


# ---------------------------------------------------------------------------------------- sampling


def _sample_pose(rng: np.random.Generator) -> dict[str, np.ndarray | float]:
    """Joint angles in degrees: paired angles as ``[right, left]`` arrays, trunk and head as floats."""
    u = rng.uniform
    kind = rng.choice(5, p=[0.3, 0.3, 0.15, 0.1, 0.15])
    p: dict[str, np.ndarray | float] = {}
    # defaults: standing
    p["hip_flex"] = rng.normal(0, 6, 2)
    p["hip_abd"] = u(0, 12, 2)
    p["hip_rot"] = u(-10, 20, 2)
    p["knee"] = u(0, 15, 2)
    p["ankle"] = u(-5, 10, 2)
    p["sh_flex"] = rng.normal(5, 15, 2)
    p["sh_abd"] = u(2, 35, 2)
    p["sh_rot"] = u(-20, 40, 2)
    p["elbow"] = u(0, 100, 2)
    p["trunk_flex"], p["trunk_lat"], p["trunk_twist"] = u(-5, 12), u(-8, 8), u(-15, 15)
    p["neck_flex"], p["neck_lat"], p["head_turn"] = u(-20, 30), u(-15, 15), u(-45, 45)
    if kind == 1:  # walk / run: legs and arms swing in opposition, the rear knee bends
        a = u(10, 45)
        p["hip_flex"] = np.array([a, -0.7 * a + rng.normal(0, 5)])
        p["knee"] = np.array([u(0, 30), u(10, 90)])
        p["sh_flex"] = np.array([-0.8 * a, 0.8 * a]) + rng.normal(0, 8, 2)
        p["elbow"] = u(10, 110, 2)
        p["trunk_flex"] = u(0, 20)
    elif kind == 2:  # one or both arms raised
        arms = rng.random(2) < np.array([0.8, 0.5])
        p["sh_abd"] = np.where(arms, u(60, 170, 2), p["sh_abd"])
        p["sh_flex"] = np.where(arms, u(-10, 90, 2), p["sh_flex"])
        p["elbow"] = np.where(arms, u(0, 120, 2), p["elbow"])
    elif kind == 3:  # crouch / sit
        hf = u(50, 115, 2)
        p["hip_flex"] = hf
        p["knee"] = np.minimum(hf * u(0.8, 1.3, 2), 135)
        p["hip_abd"] = u(0, 35, 2)
        p["trunk_flex"] = u(5, 45)
        p["sh_flex"] = u(0, 90, 2)
        p["elbow"] = u(0, 120, 2)
    elif kind == 4:  # free: uniform within the limits (knee and elbow favour small bends)
        for k in _PAIRED:
            lo, hi = ANGLE_LIMITS[k]
            p[k] = lo + (hi - lo) * (rng.beta(1.2, 2.2, 2) if k in ("knee", "elbow", "sh_flex", "sh_abd") else rng.random(2))
        for k in ("trunk_flex", "trunk_lat", "trunk_twist"):
            lo, hi = ANGLE_LIMITS[k]
            p[k] = u(lo, hi) if k != "trunk_flex" else u(lo, 35)
    if rng.random() < 0.5:  # mirrored pose: left and right swap, sideways angles change sign
        for k in _PAIRED:
            p[k] = np.asarray(p[k])[::-1].copy()
        for k in ("trunk_lat", "trunk_twist", "neck_lat", "head_turn"):
            p[k] = -float(p[k])
    for k, (lo, hi) in ANGLE_LIMITS.items():
        p[k] = np.minimum(np.maximum(p[k], lo), hi) if k in _PAIRED else float(min(max(p[k], lo), hi))
    return p


def _sample_body(rng: np.random.Generator) -> dict[str, float]:
    body = {}
    for name, (_, nominal) in SEGMENTS.items():
        var = WIDTH_VARIATION if name in _WIDTHS else SEGMENT_VARIATION
        body[name] = nominal * rng.uniform(1 - var, 1 + var)
    body["build"] = rng.uniform(0.85, 1.2)
    body["head_width"] = _HEAD_HALF_WIDTH * rng.uniform(0.9, 1.1)
    return body


def _sample_view(rng: np.random.Generator, free_view: float) -> np.ndarray:
    free = rng.random() < free_view
    yaw = rng.uniform(-180, 180) if free else rng.uniform(-60, 60)
    pitch = rng.uniform(-15, 15)
    roll = min(max(float(rng.normal(0, 7)), -20.0), 20.0)
    return _rz(math.radians(roll)) @ _rx(math.radians(pitch)) @ _ry(math.radians(yaw))


# ---------------------------------------------------------------------------------------- skeleton


def _skeleton(pose: dict, body: dict, view: np.ndarray) -> tuple[np.ndarray, dict]:
    """3-D joints ``[16, 3]`` in camera axes (x right, y up, z towards the camera; unit = standing height,
    origin = pelvis) and the drawing geometry (limb directions, head frame)."""
    d = {k: np.radians(v) for k, v in pose.items()}
    J = np.zeros((16, 3))
    hw, sw = body["hip_width"] / 2, body["shoulder_width"] / 2
    J[R_HIP], J[L_HIP] = (-hw, 0, 0), (hw, 0, 0)
    trunk = _rz(d["trunk_lat"]) @ _rx(d["trunk_flex"]) @ _ry(d["trunk_twist"])
    J[THORAX] = trunk @ (_UP * body["trunk"])
    J[R_SHOULDER] = J[THORAX] + trunk @ np.array([-sw, 0, 0])
    J[L_SHOULDER] = J[THORAX] + trunk @ np.array([sw, 0, 0])
    head = trunk @ _rz(d["neck_lat"]) @ _rx(d["neck_flex"]) @ _ry(d["head_turn"])
    J[UPPER_NECK] = J[THORAX] + head @ (_UP * body["neck"])
    J[HEAD_TOP] = J[UPPER_NECK] + head @ (_UP * body["head"])
    geo: dict = {"trunk": trunk, "head": head}
    for side, sign, (hip, knee, ankle), (sh, elb, wri) in (
        (0, -1, (R_HIP, R_KNEE, R_ANKLE), (R_SHOULDER, R_ELBOW, R_WRIST)),
        (1, 1, (L_HIP, L_KNEE, L_ANKLE), (L_SHOULDER, L_ELBOW, L_WRIST)),
    ):
        thigh = _rz(sign * d["hip_abd"][side]) @ _rx(-d["hip_flex"][side]) @ _ry(sign * d["hip_rot"][side])
        shin = thigh @ _rx(d["knee"][side])
        J[knee] = J[hip] + thigh @ (_DOWN * body["thigh"])
        J[ankle] = J[knee] + shin @ (_DOWN * body["shin"])
        geo[("foot", side)] = shin @ _rx(-d["ankle"][side]) @ _FWD
        arm = trunk @ _rz(sign * d["sh_abd"][side]) @ _rx(-d["sh_flex"][side]) @ _ry(sign * d["sh_rot"][side])
        fore = arm @ _rx(-d["elbow"][side])
        J[elb] = J[sh] + arm @ (_DOWN * body["upper_arm"])
        J[wri] = J[elb] + fore @ (_DOWN * body["forearm"])
        geo[("hand", side)] = fore @ _DOWN
    J[PELVIS] = (J[R_HIP] + J[L_HIP]) / 2
    cam = J @ view.T
    geo = {k: view @ v for k, v in geo.items()}  # directions and frames in camera axes
    geo["trunk_corners"] = _torso_corners(J, body, trunk) @ view.T
    return cam, geo


def _torso_corners(J: np.ndarray, body: dict, trunk: np.ndarray) -> np.ndarray:
    """Corners ``[8, 3]`` of the trunk box: shoulder breadth plus flesh at the thorax (trunk axes), hip breadth
    plus flesh at the pelvis (pelvis axes), chest / pelvis depth front and back."""
    fs, fh = (f * body["build"] for f in _TORSO_FLESH)
    dep = _TORSO_DEPTH * body["build"]
    pts = []
    for centre, half, R in ((J[THORAX], body["shoulder_width"] / 2 + fs, trunk), (J[PELVIS], body["hip_width"] / 2 + fh, np.eye(3))):
        for a in (-1, 1):
            for b in (-1, 1):
                pts.append(centre + R @ np.array([a * half, 0.0, b * dep]))
    return np.array(pts)
