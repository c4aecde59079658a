"""Review 19: the DEADLINE_EXCEEDED of a call whose inputs took its whole `timeout` to decode said
`took 0.000 s, past its timeout (0.000 s: ...)` for a tiny timeout (`timeout=1`: tritonclient's is in
microseconds): the figures hid the values. Now each is shown in a unit that keeps it: microseconds
below a millisecond, milliseconds below a second, seconds above.

The servicer's own `_left` (what is left of a call's timeout once its inputs are decoded), on a
stand-in clock (its `clock`, as the servicer takes one), without a manager (it needs none)."""

from __future__ import annotations

import pytest

from manager.api.oip import InferenceServicer
from manager.errors import DeadlineExceeded


def _servicer(now: float) -> InferenceServicer:
    servicer = InferenceServicer.__new__(InferenceServicer)
    servicer.clock = lambda: now
    return servicer


@pytest.mark.parametrize(
    ("timeout_s", "spent_s", "took", "timeout"),
    [
        (1e-6, 412e-6, "412 µs", "1 µs"),
        (250e-6, 0.0123, "12.3 ms", "250 µs"),
        (0.005, 0.0056, "5.6 ms", "5.0 ms"),
        (1.5, 2.25, "2.250 s", "1.500 s"),
    ],
)
def test_the_deadline_message_shows_its_figures(
    timeout_s: float, spent_s: float, took: str, timeout: str
) -> None:
    arrived = 100.0
    with pytest.raises(DeadlineExceeded) as e:
        _servicer(arrived + spent_s)._left("voice", timeout_s, arrived)
    assert str(e.value) == (
        f"model 'voice': receiving and decoding the request's inputs took {took}, past its timeout "
        f"({timeout}: its `timeout` parameter or the call's deadline); it was not run"
    )


def test_what_is_left_is_returned_when_time_remains() -> None:
    assert _servicer(100.0 + 200e-6)._left("voice", 1e-3, 100.0) == pytest.approx(800e-6)
