"""Shared test plumbing: directory markers and a narrated engine driver.

- Every test under `tests/unit/` is marked `unit` (and `tests/integration/` -> `integration`,
  `tests/gpu/` -> `gpu`), so `pytest -m unit` selects the pure-Python suite.
- `Scenario` (the `drive` fixture) drives an `Engine` the way the replay simulator does
  (observe -> admit -> finish -> after_request) on a plain float clock, so a test reads as one
  step per line.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import settings

from manager.config import Config
from manager.policy.engine import Admission, Engine
from manager.policy.factory import create_policy
from manager.policy.state import DeviceState, ModelState
from manager.policy.types import Action, ActionKind, Request, Tier

# Property tests assert behaviour, not speed: no per-example deadline (a loaded 2-core CI machine
# must not turn a slow example into a failure).
settings.register_profile("residency", deadline=None)
settings.load_profile("residency")

TESTS = Path(__file__).resolve().parent

# A config without `policy.timezone` reads times on this machine's zone. The synthetic weeks are on
# UTC's wall clock and the golden figures were taken there: a zone a whole number of hours from UTC
# gives the same figures (a week without a change of the clocks), a half-hour one (Asia/Kolkata) not.
# So the tests run on UTC wherever they run; those about zones name theirs.
os.environ["TZ"] = "UTC"

# tests/e2e drives the server with tritonclient, whose generated `inference` protos and ours cannot
# share one process's descriptor pool (same message names). The servers run in subprocesses anyway;
# the e2e tests run in a pytest process of their own: `RESIDENCY_E2E=1 pytest tests/e2e` (make test).
collect_ignore = [] if os.environ.get("RESIDENCY_E2E") == "1" else ["e2e"]
_DIR_MARKERS = {
    "unit": pytest.mark.unit,
    "integration": pytest.mark.integration,
    "gpu": pytest.mark.gpu,
    "e2e": pytest.mark.e2e,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test by its top folder under tests/ (unit, integration, gpu)."""
    for item in items:
        try:
            top = Path(str(item.path)).resolve().relative_to(TESTS).parts[0]
        except (ValueError, IndexError):
            continue
        marker = _DIR_MARKERS.get(top)
        if marker is not None:
            item.add_marker(marker)


# ---- the driver -----------------------------------------------------------------------------------


class Scenario:
    """An engine plus the simulator's per-request steps, on a float clock.

    `plan` is the future the oracle is told (the other policies ignore it); every request the test
    sends must then be in it (unless marked `surprise`), so the oracle is not misled by accident.
    """

    def __init__(self, config: Config, policy: str, plan: Sequence[Request] = ()) -> None:
        self.config = config
        self.plan = [(r.model, r.t) for r in plan]
        self.engine = Engine(config, create_policy(policy, list(plan)))
        self.engine.actions = []
        self.class_rank = {c.name: i for i, c in enumerate(config.classes)}

    # state ------------------------------------------------------------------------------------
    def m(self, name: str) -> ModelState:
        return self.engine.models[name]

    def tier(self, name: str) -> Tier:
        return self.engine.models[name].tier

    def on_gpu(self) -> set[str]:
        return {n for n, m in self.engine.models.items() if m.tier == Tier.GPU}

    @property
    def dev(self) -> DeviceState:
        return self.engine.state.devices["gpu0"]

    @property
    def actions(self) -> list[tuple[float, Action]]:
        assert self.engine.actions is not None
        return self.engine.actions

    def evicted(self) -> list[str]:
        """Models taken off the GPU (demoted or dropped) since the actions were last cleared."""
        return [
            a.model
            for _, a in self.actions
            if a.kind in (ActionKind.DEMOTE, ActionKind.DROP) and a.device != "host"
        ]

    def kinds(self) -> list[ActionKind]:
        return [a.kind for _, a in self.actions]

    def clear(self) -> None:
        self.engine.actions = []

    # steps ------------------------------------------------------------------------------------
    def start(self, now: float = -600.0) -> None:
        self.engine.start(now)

    def request(
        self, name: str, t: float, busy: float = 1.0, cls: str | None = None, *, surprise: bool = False
    ) -> Admission:
        """One request, as the simulator handles it; returns the admission. `surprise`: a request
        deliberately left out of the plan."""
        if self.plan and not surprise:
            assert (name, t) in self.plan, f"({name}, {t}) is not in the oracle's plan"
        eng, m = self.engine, self.engine.models[name]
        rank = m.rank if cls is None else self.class_rank[cls]
        eng.observe(m, t)
        adm = eng.admit(m, rank, t)
        if adm.status in ("hit", "load"):
            eng.finish(m, max(t, adm.ready_at, m.busy_until), busy)
            eng.after_request(m, t)
        return adm

    def retry(self, name: str, t: float, cls: str | None = None) -> Admission:
        """A waiting request tried again (no new arrival is observed)."""
        m = self.engine.models[name]
        rank = m.rank if cls is None else self.class_rank[cls]
        return self.engine.admit(m, rank, t)

    def tick(self, t: float) -> None:
        self.engine.tick(t)


@pytest.fixture
def drive() -> type[Scenario]:
    """`drive(config, policy, plan)` -> a `Scenario` (a fixture, so test modules need not import
    conftest)."""
    return Scenario


@pytest.fixture
def tls_pair(tmp_path: Path) -> tuple[Path, Path]:
    """A fresh self-signed certificate for localhost and 127.0.0.1, and its key: (cert, key) files."""
    import subprocess

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key
