"""Review 17: with `place_by_id` (how the session always prepares a step: slots in id order) the
page manager also handed out host room in id order, so when room was short for the reads the oldest
segment won and the retrieval rule's best was marked unavailable, against its docstring and
`Session._prepare` ("the best are kept"). Room now goes best first; the slots are still in id order."""

from __future__ import annotations

from test_review17_worldpager_pages import SEG, _clean

from worldpager.pages import PageManager


def test_short_host_room_goes_to_the_best_wanted_segment() -> None:
    pm = PageManager(4 * SEG, 40, 4)  # the host holds four segments
    _clean(pm, 3, 4, 5)
    pm.add_on_nvme(0, SEG)
    pm.add_on_nvme(1, SEG)
    pm.prepare_step(0, [3, 4, 5])  # 3, 4 and 5 protected by step 0: room for one read
    plan = pm.prepare_step(1, [1, 0], place_by_id=True)  # 1 is the rule's best
    assert list(plan.slots) == [1] and plan.unavailable == (0,)
    pm.check()


def test_slots_stay_in_id_order() -> None:
    pm = PageManager(8 * SEG, 40, 4)
    _clean(pm, 1, 2, 3)
    plan = pm.prepare_step(0, [3, 1, 2], place_by_id=True)
    assert plan.slots == {1: 0, 2: 1, 3: 2}
    pm.check()
