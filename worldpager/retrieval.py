"""Retrieval rules: which stored segments come back for the next segment.

WorldPager does not invent a retrieval rule; it runs the model's own rule one step early, on the
*predicted* pose of the next segment, so the chosen segments can be prefetched while the current
segment computes. This module is plain Python and numpy (no torch) and has no tiers, tensors or
clocks in it: a rule gets the pose index of stored segments and returns segment ids.

Primitives, in the order a caller uses them:

1. `predict_pose(history, steps_ahead)` — constant-velocity guess of the next segment's pose.
2. `outside_window(candidates, now_frame, window_frames)` — drop segments still in the rolling
   window (the rules themselves never filter; they rank whatever they are given).
3. `RetrievalRule.select(candidates, query, now_frame, k)` — segment ids, best first, at most `k`:
   * `RecencyRule` — the `k` newest segments (a baseline).
   * `FovOverlapRule` — WorldMem's rule (`_generate_condition_indices`): points sampled uniformly in
     a sphere around the query position, FOV masks with separate horizontal/vertical half-angles,
     `confidence = overlap − w·(now − frame_start)/now`, greedy set cover.

Conventions (WorldMem's): `y` is up; yaw is the azimuth `atan2(x, z)` in degrees, so yaw 0 looks
along +z ("north") and yaw 90 along +x ("east"); pitch is the elevation above the horizontal plane
in degrees, positive up, expected in [−90, 90]. A segment covers the half-open frame range
`[frame_start, frame_end)`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

__all__ = [
    "POSE_LIMIT",
    "WORLDMEM_POINTS",
    "FovOverlapRule",
    "Pose",
    "RecencyRule",
    "RetrievalRule",
    "SegmentInfo",
    "check_pose",
    "outside_window",
    "predict_pose",
    "wrap_degrees",
]


@dataclass(frozen=True)
class Pose:
    """A camera pose: position and view direction (degrees; see the module docstring for axes)."""

    x: float
    y: float
    z: float
    pitch: float
    yaw: float


POSE_LIMIT = 1e6
"""The largest |value| a client's pose may hold (positions in world units, angles in degrees): room
for any scene, and far from where predicting or storing poses could overflow."""


def check_pose(pose: Pose) -> None:
    """ValueError unless every value of a client's pose is a finite number within ±POSE_LIMIT."""
    values = (pose.x, pose.y, pose.z, pose.pitch, pose.yaw)
    if not all(isinstance(v, int | float) and math.isfinite(v) and abs(v) <= POSE_LIMIT for v in values):
        raise ValueError(
            f"pose {values}: x, y, z, pitch and yaw must be finite numbers within ±{POSE_LIMIT:g}"
        )


@dataclass(frozen=True)
class SegmentInfo:
    """What a retrieval rule knows about a stored segment.

    `pose` is the segment's representative camera pose (e.g. its middle frame's); frames are the
    half-open range `[frame_start, frame_end)` in the session's true (un-rebased) frame count.
    """

    segment_id: int
    frame_start: int
    frame_end: int
    pose: Pose


@runtime_checkable
class RetrievalRule(Protocol):
    """Chooses the stored segments to bring back for the segment about to be generated."""

    def select(self, candidates: Sequence[SegmentInfo], query: Pose, now_frame: int, k: int) -> list[int]:
        """Segment ids, best first, at most `k`, no duplicates, all taken from `candidates`.

        Args:
            candidates: stored segments eligible for retrieval (the caller has already removed
                those still in the rolling window, e.g. with `outside_window`). Segment ids must be
                unique.
            query: the (predicted) pose of the segment to be generated.
            now_frame: the first frame of the segment to be generated.
            k: the number of retrieval slots; `k <= 0` returns `[]`.

        Returns the same list for the same arguments (rules are deterministic).
        """
        ...


def wrap_degrees(angle: float) -> float:
    """`angle` wrapped to (−180, 180]."""
    r = math.fmod(angle, 360.0)
    if r > 180.0:
        r -= 360.0
    elif r <= -180.0:
        r += 360.0
    return r


def predict_pose(history: Sequence[Pose], steps_ahead: int = 1) -> Pose:
    """Constant-velocity extrapolation from the last two poses of `history`.

    Position and pitch move by `steps_ahead` times the last step; yaw moves by `steps_ahead` times
    the last step taken the short way round (350° → 10° is +20°, not −340°) and is wrapped to
    (−180, 180]; pitch is clamped to [−90, 90]. With a single pose, that pose is returned unchanged.

    Raises:
        ValueError: `history` is empty or `steps_ahead` is negative.
    """
    if not history:
        raise ValueError("predict_pose needs at least one pose")
    if steps_ahead < 0:
        raise ValueError(f"steps_ahead must be >= 0, got {steps_ahead}")
    last = history[-1]
    if len(history) == 1:
        return last
    prev = history[-2]
    n = float(steps_ahead)
    return Pose(
        x=last.x + n * (last.x - prev.x),
        y=last.y + n * (last.y - prev.y),
        z=last.z + n * (last.z - prev.z),
        pitch=min(90.0, max(-90.0, last.pitch + n * (last.pitch - prev.pitch))),
        yaw=wrap_degrees(last.yaw + n * wrap_degrees(last.yaw - prev.yaw)),
    )


def outside_window(
    candidates: Sequence[SegmentInfo], now_frame: int, window_frames: int
) -> list[SegmentInfo]:
    """The candidates that have fully left a rolling window of the last `window_frames` frames.

    A segment is still in the window (and so is dropped) when `frame_end > now_frame − window_frames`.
    Order is kept.
    """
    cutoff = now_frame - window_frames
    return [c for c in candidates if c.frame_end <= cutoff]


class RecencyRule:
    """The `k` most recent candidates, newest first (a baseline that ignores poses).

    Recency is `frame_start`, then `frame_end` (both descending); equal ranges fall back to the
    smaller `segment_id`. The rule does not filter the rolling window; see `outside_window`.
    """

    def select(self, candidates: Sequence[SegmentInfo], query: Pose, now_frame: int, k: int) -> list[int]:
        if k <= 0:
            return []
        _check_unique(candidates)
        ranked = sorted(candidates, key=lambda c: (-c.frame_start, -c.frame_end, c.segment_id))
        return [c.segment_id for c in ranked[:k]]


_Point = tuple[float, float, float]
_Points = npt.NDArray[np.float64]  # (n, 3)
_Flags = npt.NDArray[np.bool_]

WORLDMEM_POINTS = 10_000
"""WorldMem's `_generate_condition_indices` samples 10,000 points in the sphere."""


def _to_bitset(flags: _Flags) -> int:
    """Flags as an int bitset: flags[i] is bit i, so n flags fit in `(1 << n) - 1`."""
    return int.from_bytes(np.packbits(flags, bitorder="little").tobytes(), "little")


def _angle_diff(a: float, b: float) -> float:
    """|a − b| the short way round, in [0, 180]."""
    return abs(wrap_degrees(a - b))


class FovOverlapRule:
    """WorldMem's FOV-overlap retrieval with a recency term and greedy set cover.

    For a query pose, `k_points` points sampled uniformly in a sphere of `radius` around the query
    position stand in for "the scene the next segment will see". A pose's FOV set is the points
    whose horizontal angle (azimuth `atan2(x, z)` from the camera) is within `h_fov/2` of its yaw and
    whose elevation is within `v_fov/2` of its pitch — WorldMem's `is_inside_fov_3d_hv`, which
    measures the vertical angle against the horizontal plane rather than in a rotated camera frame.
    With `h_fov < 180` a point in the FOV is always in front of the camera.

    `select` then repeats up to `k` times: for every unchosen candidate,
    `overlap = |FOV_query ∧ FOV_candidate| / |FOV_query|` and
    `confidence = overlap − recency_weight · (now_frame − frame_start) / now_frame`; the best is
    taken and the points it covers are removed from `FOV_query` (greedy set cover), so the next
    pick favours views of what is still uncovered. Unlike WorldMem, it stops as soon as no candidate
    adds coverage instead of padding with frame 0, so it may return fewer than `k` ids.

    Determinism: the sphere offsets come from `random.Random(seed)` once per instance; exact
    confidence ties go to the newer segment (larger `frame_start`), then the smaller `segment_id`,
    independent of the order of `candidates`.

    Points: WorldMem's 10,000 by default (`WORLDMEM_POINTS`); an overlap is a share of the query's
    FOV points (about 1,800 of them with the defaults), so fewer points make it coarser.

    Cost: only the query's FOV points (about 18 % of the sphere with the defaults) are tested per
    candidate, in one numpy pass; each candidate's set is computed once per query and kept as a
    Python int bitset, so the greedy loop is AND + `int.bit_count()`. Sets are cached by segment id
    while the query pose stays the same (a repeated or re-planned call costs only the greedy loop);
    a new query pose clears the cache. Not thread-safe: give each thread its own instance.

    Raises:
        ValueError: a parameter is out of range (`k_points >= 1`, `radius > 0`,
            `0 < h_fov < 180`, `0 < v_fov < 180`, `recency_weight >= 0`).
    """

    def __init__(
        self,
        k_points: int = WORLDMEM_POINTS,
        radius: float = 30.0,
        h_fov: float = 105.0,
        v_fov: float = 75.0,
        recency_weight: float = 0.2,
        seed: int = 0,
    ) -> None:
        if k_points < 1:
            raise ValueError(f"k_points must be >= 1, got {k_points}")
        if not radius > 0.0 or not math.isfinite(radius):
            raise ValueError(f"radius must be a positive finite number, got {radius}")
        if not 0.0 < h_fov < 180.0:
            raise ValueError(f"h_fov must be in (0, 180) degrees, got {h_fov}")
        if not 0.0 < v_fov < 180.0:
            raise ValueError(f"v_fov must be in (0, 180) degrees, got {v_fov}")
        if not recency_weight >= 0.0 or not math.isfinite(recency_weight):
            raise ValueError(f"recency_weight must be a finite number >= 0, got {recency_weight}")
        self.k_points = k_points
        self.radius = float(radius)
        self.h_fov = float(h_fov)
        self.v_fov = float(v_fov)
        self.recency_weight = float(recency_weight)
        self.seed = seed
        self._half_h = self.h_fov / 2.0
        self._half_v = self.v_fov / 2.0
        self._tan_half_h = math.tan(math.radians(self._half_h))
        points = _sphere_points(k_points, self.radius, random.Random(seed))
        self._points: _Points = np.array(points, dtype=np.float64).reshape(-1, 3)
        # Per-query cache: the query's FOV points and, by segment id, (pose, bitset over them).
        self._query: Pose | None = None
        self._query_points: _Points = self._points[:0]
        self._sets: dict[int, tuple[Pose, int]] = {}

    @property
    def offsets(self) -> tuple[_Point, ...]:
        """The sampled sphere points, relative to the query position."""
        return tuple((x, y, z) for x, y, z in self._points.tolist())

    # ---- FOV sets ---------------------------------------------------------------------------

    def _flags(self, points: _Points, dx: float, dy: float, dz: float, pose: Pose) -> _Flags:
        """For each offset `o`, whether the point `o + d` (camera at the origin) is in `pose`'s FOV.

        `d` is query position − camera position. Trig-free per point: the horizontal test is
        `forward > 0 and |right| < tan(h/2)·forward`, the vertical one compares `y` with
        `tan(pitch ± v/2)·ρ` (ρ the horizontal distance), open where the bound passes ±90°.
        """
        yaw = math.radians(pose.yaw)
        s, c = math.sin(yaw), math.cos(yaw)
        f0 = dx * s + dz * c
        r0 = dx * c - dz * s
        lo = pose.pitch - self._half_v
        hi = pose.pitch + self._half_v
        t_lo = math.tan(math.radians(lo)) if lo > -90.0 else -math.inf
        t_hi = math.tan(math.radians(hi)) if hi < 90.0 else math.inf
        ox, oy, oz = points[:, 0], points[:, 1], points[:, 2]
        f = ox * s + oz * c + f0
        r = ox * c - oz * s + r0
        rho = np.sqrt(f * f + r * r)
        y = oy + dy
        with np.errstate(invalid="ignore"):  # ±inf·0 where rho is 0: there forward <= 0 already fails
            out: _Flags = (f > 0.0) & (np.abs(r) < self._tan_half_h * f) & (t_lo * rho < y) & (y < t_hi * rho)
        return out

    def _may_see_sphere(self, dx: float, dz: float, pose: Pose) -> bool:
        """False only when the whole sphere lies outside `pose`'s horizontal FOV (cheap cull)."""
        rho = math.hypot(dx, dz)
        if rho <= self.radius * (1.0 + 1e-9):
            return True
        spread = math.degrees(math.asin(self.radius / rho))
        towards = math.degrees(math.atan2(dx, dz))
        return _angle_diff(towards, pose.yaw) < self._half_h + spread + 1e-6

    def _set_for(self, query: Pose, pose: Pose) -> int:
        """`pose`'s FOV set as a bitset over the current query's FOV points."""
        dx, dy, dz = query.x - pose.x, query.y - pose.y, query.z - pose.z
        if not len(self._query_points) or not self._may_see_sphere(dx, dz, pose):
            return 0
        return _to_bitset(self._flags(self._query_points, dx, dy, dz, pose))

    def _prepare(self, query: Pose) -> None:
        """Switch the per-query cache to `query` (a no-op if it is already there)."""
        if self._query == query:
            return
        inside = self._flags(self._points, 0.0, 0.0, 0.0, query)
        self._query = query
        self._query_points = self._points[inside]
        self._sets = {}

    def fov_size(self, query: Pose) -> int:
        """|FOV_query|: how many of the sampled points the query pose sees."""
        self._prepare(query)
        return len(self._query_points)

    def overlap(self, candidate: Pose, query: Pose) -> float:
        """`|FOV_query ∧ FOV_candidate| / |FOV_query|` on this rule's points (0.0 if the query sees none)."""
        self._prepare(query)
        n = len(self._query_points)
        return self._set_for(query, candidate).bit_count() / n if n else 0.0

    # ---- selection --------------------------------------------------------------------------

    def select(self, candidates: Sequence[SegmentInfo], query: Pose, now_frame: int, k: int) -> list[int]:
        if k <= 0 or not candidates:
            return []
        _check_unique(candidates)
        self._prepare(query)
        remaining_count = len(self._query_points)
        if remaining_count == 0:
            return []
        denom = float(max(now_frame, 1))
        # Newest first, so that a strict ">" below breaks exact ties toward newer segments.
        pool: list[tuple[int, int, float]] = []  # (segment id, bitset, recency penalty)
        for cand in sorted(candidates, key=lambda c: (-c.frame_start, c.segment_id)):
            cached = self._sets.get(cand.segment_id)
            if cached is not None and cached[0] == cand.pose:
                bits = cached[1]
            else:
                bits = self._set_for(query, cand.pose)
                self._sets[cand.segment_id] = (cand.pose, bits)
            if bits:
                penalty = self.recency_weight * (now_frame - cand.frame_start) / denom
                pool.append((cand.segment_id, bits, penalty))

        remaining = (1 << remaining_count) - 1
        chosen: list[int] = []
        while pool and len(chosen) < k:
            best = -1
            best_conf = -math.inf
            useful: list[tuple[int, int, float]] = []
            for entry in pool:
                gain = (entry[1] & remaining).bit_count()
                if gain == 0:
                    continue  # the uncovered set only shrinks: it never gains again
                conf = gain / remaining_count - entry[2]
                if conf > best_conf:
                    best_conf, best = conf, len(useful)
                useful.append(entry)
            if best < 0:
                break
            seg_id, bits, _ = useful.pop(best)
            chosen.append(seg_id)
            remaining &= ~bits
            remaining_count = remaining.bit_count()
            if remaining_count == 0:
                break
            pool = useful
        return chosen


def _sphere_points(n: int, radius: float, rng: random.Random) -> tuple[_Point, ...]:
    """`n` points uniform in the ball of `radius` at the origin (WorldMem's `generate_points_in_sphere`)."""
    out: list[_Point] = []
    for _ in range(n):
        r = radius * rng.random() ** (1.0 / 3.0)
        phi = 2.0 * math.pi * rng.random()
        theta = math.acos(1.0 - 2.0 * rng.random())
        out.append(
            (r * math.sin(theta) * math.cos(phi), r * math.sin(theta) * math.sin(phi), r * math.cos(theta))
        )
    return tuple(out)


def _check_unique(candidates: Sequence[SegmentInfo]) -> None:
    ids = [c.segment_id for c in candidates]
    if len(set(ids)) != len(ids):
        raise ValueError("candidate segment ids must be unique")
