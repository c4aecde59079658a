"""Found in the 29th review (a fuzz of configs and traces the validator takes): under `residency`, a
learned (`auto`) keep-alive became infinite once the model's 95th-percentile reuse interval was
past the reuse histogram's top edge (1.25^60 s, about 7.5 days): a model asked for every 9 days
held its room for good, and the requests of a class that may not evict, which take only room held
past its keep-alive, were refused "no room became free" though it sat idle for days. The learned
keep-alive is now at most that top edge. Real components: the replay and the residency policy."""

from __future__ import annotations

import math
from pathlib import Path

from manager.config import load_config
from manager.policy.stats import EDGES
from manager.policy.types import Request
from manager.replay.sim import Simulator

CONFIG = """
devices:
  - {name: gpu0, kind: cuda, index: 0, memory: 10GiB}
host: {memory: 32GiB, reserve: 4GiB}
classes:
  - {name: interactive}
  - {name: background, may_evict: false}
models:
  - {name: big, class: interactive, adapter: torchscript, device: gpu0, memory: 8GiB, source: {path: m.pt}}
  - {name: bg, class: background, adapter: torchscript, device: gpu0, memory: 4GiB, prewarm: false,
     source: {path: m.pt}}
"""
T0 = 1_700_000_000.0
NINE_DAYS = 9 * 86400.0


def test_a_model_asked_for_every_nine_days_keeps_its_room_no_longer_than_the_histogram_reaches(
    tmp_path: Path,
) -> None:
    (tmp_path / "c.yaml").write_text(CONFIG)
    config = load_config(tmp_path / "c.yaml")
    reqs: list[Request] = []
    for i in range(8):  # big every 9 days, a background batch an hour after each
        reqs.append(Request(t=T0 + i * NINE_DAYS, model="big", busy_s=1.0))
        reqs.append(Request(t=T0 + i * NINE_DAYS + 3600.0, model="bg", busy_s=1.0))
    reqs.append(Request(t=T0 + 8 * NINE_DAYS, model="big", busy_s=1.0))  # (the trace goes on)
    sim = Simulator(config, reqs, "residency")
    result = sim.run()
    big = sim.engine.models["big"]
    learned = sim.engine.policy.keep_alive(big, reqs[-1].t)
    assert math.isfinite(learned) and learned <= EDGES[-1]
    assert result.rejected == 0, result.reject_reasons  # each batch got the room once it expired
    assert result.served == len(reqs)
    assert result.wait_p99_s["background"] <= EDGES[-1]  # (a lazy keep-alive is waited out)
