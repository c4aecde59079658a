"""Review 16: a segment whose NVMe copy was found corrupt (LOST) no longer takes a retrieval pick from
segments that can still be retrieved."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from worldpager.model import TINY, TinyCausalWan
from worldpager.page_types import SegState
from worldpager.retrieval import Pose, SegmentInfo
from worldpager.segment_log import HEADER_SIZE
from worldpager.session import Session


class OldestAfterRuleForTests:
    """A test rule: nothing before frame ``start``, then the ``k`` oldest candidates."""

    def __init__(self, start: int) -> None:
        self.start = start

    def select(self, candidates: Sequence[SegmentInfo], query: Pose, now_frame: int, k: int) -> list[int]:
        if now_frame < self.start or k <= 0:
            return []
        return sorted(c.segment_id for c in candidates)[:k]


def test_a_lost_segment_is_not_retrieved_again_in_place_of_a_good_one(tmp_path: Path) -> None:
    model = TinyCausalWan(TINY.on_the_fly())
    fpb = TINY.frames_per_block
    pose = Pose(0.0, 0.0, 0.0, 0.0, 0.0)
    session = Session(
        model, host_budget_bytes=3 * 36864, log_dir=tmp_path / "log", retrieval_k=2,
        rule=OldestAfterRuleForTests(start=8 * fpb), trim_memory=False,
    )  # fmt: skip
    assert session.segment_bytes == 36864
    try:
        for _ in range(7):
            session.step(pose)
        assert session.wait_written(0)
        assert session.pm.lookup(0).state is SegState.NVME  # type: ignore[union-attr]
        slot = session.log.find(0)
        assert slot is not None
        with open(session.log.path, "r+b") as f:  # damage segment 0's payload on disk
            f.seek(slot * session.log.slot_size + HEADER_SIZE + 100)
            f.write(b"\xff" * 64)
        session.step(pose)  # step 7 prefetches step 8: [0, 1]
        rec = session.step(pose)  # step 8: segment 0 fails its check and is lost
        assert rec.retrieved == (1,)
        assert session.pm.lookup(0).state is SegState.LOST  # type: ignore[union-attr]
        rec = session.step(pose)  # step 9: the two oldest segments that can still come back
        assert rec.retrieved == (1, 2)
        assert session.wanted(10) == [1, 2]
    finally:
        session.close()
