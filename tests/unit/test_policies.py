"""One narrated scenario per policy, showing the behaviour that defines it.

- lru-keepalive (Ollama): a fixed 5-minute keep-alive whatever the config says, then unloaded;
  at most 3 models per device; ties broken by name.
- histogram (Serverless in the Wild): with few samples, the default keep-alive; with a learned
  histogram, its own keep-alive window.
- gdsf: evicts the lowest H = L + cost x freq / size: a cheap-to-reload, large, rarely used model
  goes first, however recently it was used.
- residency: demotes victims to host RAM, and prewarms a learned successor (A, then B seconds
  later) as soon as A is requested.
- oracle: prewarms just in time, so a request after a long gap is warm; on the shipped traces no
  online policy waits less for loads than it does.

The server is small and hand-built: one cuda device with 9 GiB usable (10 GiB, 1 GiB reserve),
one class unless said otherwise, 12 GiB of host RAM for the host tier and the page cache.
"""

from __future__ import annotations

from typing import Any

import pytest

from manager.config import Config, load_config
from manager.policy.baselines import MIN_SAMPLES
from manager.policy.factory import POLICY_NAMES
from manager.policy.types import ActionKind, Request, Tier
from manager.replay.sim import Simulator, replay
from manager.replay.synth import synth

GiB = 1 << 30
ADMITTED = ("hit", "load")
ONLINE = [p for p in POLICY_NAMES if p != "oracle"]


def model(name: str, memory: str, *, disk: float = 4.0, host: float = 1.0, **extra: Any) -> dict[str, Any]:
    extra.setdefault("class", "interactive")
    return {
        "name": name,
        "adapter": "test",
        "device": "gpu0",
        "memory": memory,
        "load_seconds": {"disk": disk, "host": host},
        **extra,
    }


def server(*models: dict[str, Any], memory: str = "10GiB") -> Config:
    return Config.model_validate(
        {
            "devices": [{"name": "gpu0", "kind": "cuda", "memory": memory, "reserve": "1GiB"}],
            "host": {"memory": "16GiB", "reserve": "4GiB"},
            "classes": [{"name": "interactive"}],
            "models": list(models),
            "policy": {"thrash_window": "10m", "min_residency": "1m", "default_keep_alive": "5m"},
        }
    )


def reqs(*items: tuple[str, float]) -> list[Request]:
    return [Request(t=t, model=name, busy_s=1.0) for name, t in items]


class TestLruKeepAlive:
    def test_idle_model_is_unloaded_after_five_minutes(self, drive):
        # chat's config asks for 30 minutes; Ollama's scheduler keeps every model 5 minutes.
        cfg = server(model("chat", "2GiB", keep_alive="30m"))
        sc = drive(cfg, "lru-keepalive")
        sc.start()
        assert sc.request("chat", 0.0, busy=10.0).status == "load"  # loads (4 s), serves 10 s
        idle = sc.m("chat").busy_until  # idle from t = 14
        assert idle == pytest.approx(14.0)
        sc.tick(idle + 299.0)  # 4 min 59 s idle
        assert sc.tier("chat") == Tier.GPU  # still resident
        sc.tick(idle + 300.0)  # 5 min idle
        assert sc.tier("chat") == Tier.DISK  # unloaded to disk (no host tier)
        _, drop = sc.actions[-1]
        assert (drop.kind, drop.reason) == (ActionKind.DROP, "keep-alive expired")
        assert sc.engine.counters.expiries == 1

    def test_at_most_three_models_per_device(self, drive):
        # Four 1 GiB models on a 24 GiB device: memory is no object, the count is.
        cfg = server(*(model(n, "1GiB") for n in ("a", "b", "c", "d")), memory="24GiB")
        sc = drive(cfg, "lru-keepalive")
        sc.start()
        assert sc.request("c", 0.0).status == "load"  # 1 model
        assert sc.request("a", 10.0).status == "load"  # 2 models
        assert sc.request("b", 20.0).status == "load"  # 3 models: the cap
        assert sc.request("d", 100.0).status == "load"  # a 4th: one must go, though 20 GiB are free
        assert len(sc.on_gpu()) == 3
        assert sc.evicted() == ["a"]  # equal keep-alives: ties go by name, not by recency


class TestHistogram:
    def test_few_samples_fall_back_to_the_default_keep_alive(self, drive):
        # chat is requested every 30 s; the config's keep_alive (30 min) is not the histogram's word.
        cfg = server(model("chat", "2GiB", keep_alive="30m"))
        sc = drive(cfg, "histogram")
        sc.start()
        for i in range(3):  # 3 requests: 2 intervals, far below the 10 the histogram needs
            assert sc.request("chat", 30.0 * i).status in ADMITTED
        idle = sc.m("chat").busy_until
        sc.tick(idle + 299.0)  # default keep-alive is 5 min
        assert sc.tier("chat") == Tier.GPU  # kept for now
        sc.tick(idle + 300.0)
        assert sc.tier("chat") == Tier.DISK  # unloaded at 5 min, not 30

    def test_a_learned_histogram_sets_its_own_keep_alive(self, drive):
        # The same model with enough samples: every interval is 30 s, so the keep-alive window is
        # the 99th percentile (one 1.25x bin above 30 s: 35.5 s) + 10 %, at least 1 minute.
        cfg = server(model("chat", "2GiB", keep_alive="30m"))
        sc = drive(cfg, "histogram")
        sc.start()
        for i in range(MIN_SAMPLES + 1):  # 11 requests: 10 intervals, enough to trust
            assert sc.request("chat", 30.0 * i).status in ADMITTED
        idle = sc.m("chat").busy_until
        sc.tick(idle + 59.0)
        assert sc.tier("chat") == Tier.GPU  # within the learned window
        sc.tick(idle + 60.0)
        assert sc.tier("chat") == Tier.DISK  # unloaded after 1 minute, not the 5-minute default


class TestGDSF:
    def test_cheap_large_rarely_used_model_goes_first(self, drive):
        # H = cost x freq / size (seconds per GiB), each requested once, loaded from disk:
        #   old    3 GiB, 20 s -> H = 6.7   (least recently used: LRU's victim)
        #   small  1 GiB,  4 s -> H = 4     (too small to make the room alone)
        #   cheap  3 GiB,  2 s -> H = 0.67  (the most recently used)
        cfg = server(
            model("old", "3GiB", disk=20.0, host=2.0),
            model("small", "1GiB", disk=4.0),
            model("cheap", "3GiB", disk=2.0, host=0.5),
            model("img", "5GiB"),
        )
        sc = drive(cfg, "gdsf")
        sc.start()
        assert sc.request("old", 0.0).status == "load"  # 3 GiB used
        assert sc.request("small", 50.0).status == "load"  # 4 GiB
        assert sc.request("cheap", 100.0).status == "load"  # 7 GiB
        sc.clear()
        assert sc.request("img", 200.0).status == "load"  # img needs 5 GiB: 3 more than is free
        assert sc.evicted() == ["cheap"]  # the lowest H goes, however recent
        assert sc.tier("cheap") == Tier.DISK  # gdsf has no host tier
        assert sc.engine.policy.inflation == pytest.approx(2.0 / 3.0)  # L rises to the victim's H

    def test_frequency_protects_a_model(self, drive):
        # cheap again, but requested 20 times while resident; after the first load its file is in
        # the page cache, so its cost is (2 + 0.5) / 2 = 1.25 s: H = 1.25 x 20 / 3 = 8.3 > old's 6.7.
        cfg = server(
            model("old", "3GiB", disk=20.0, host=2.0),
            model("cheap", "3GiB", disk=2.0, host=0.5),
            model("img", "5GiB"),
        )
        sc = drive(cfg, "gdsf")
        sc.start()
        assert sc.request("old", 0.0).status == "load"  # H = 20 / 3 = 6.7
        for i in range(20):
            assert sc.request("cheap", 100.0 + 10 * i).status in ADMITTED  # H grows with each use
        assert sc.request("img", 400.0).status == "load"  # img needs one of the two
        assert sc.evicted() == ["old"]  # now the costly but rarely used model has the lower H


class TestResidency:
    def test_victims_are_demoted_to_host_ram(self, drive):
        cfg = server(model("chat", "5GiB", prewarm=False), model("img", "5GiB", prewarm=False))
        sc = drive(cfg, "residency")
        sc.start()
        assert sc.request("chat", 0.0).status == "load"  # chat on the GPU
        assert sc.request("img", 100.0).status == "load"  # img needs chat's room
        assert sc.tier("chat") == Tier.HOST  # chat is parked in host RAM, not dropped
        assert [a.kind for _, a in sc.actions if a.model == "chat"][-1] == ActionKind.DEMOTE
        assert sc.request("chat", 200.0).status == "load"  # back from RAM ...
        assert sc.m("chat").ready_at == pytest.approx(201.0)  # ... in the 1 s host copy, not 4 s

    def test_a_learned_successor_is_prewarmed(self, drive):
        # `wake` (a voice front end) is followed 2 s later by `reply`; reply's keep_alive is 1 min,
        # so between rounds it is demoted to host RAM.
        cfg = server(model("wake", "1GiB"), model("reply", "5GiB", keep_alive="1m"))
        sc = drive(cfg, "residency")
        sc.start()
        for t in (0.0, 1000.0, 2000.0):  # three rounds: reply follows wake every time
            assert sc.request("wake", t).status in ADMITTED
            assert sc.request("reply", t + 2.0).status in ADMITTED
            sc.tick(t + 500.0)  # reply's keep-alive ran out: demoted
            assert sc.tier("reply") == Tier.HOST
        sc.clear()
        assert sc.request("wake", 3000.0).status == "hit"  # round four: wake arrives ...
        loads = [a for _, a in sc.actions if a.model == "reply"]
        assert [(a.kind, a.prewarm) for a in loads] == [(ActionKind.PROMOTE, True)]  # reply prewarmed
        assert sc.tier("reply") == Tier.GPU  # before its own request
        assert sc.request("reply", 3002.0).status == "hit"  # which is then warm

    def test_baselines_do_not_prewarm_the_successor(self):
        # The same rounds through gdsf: reply is loaded only when it is requested.
        cfg = server(model("wake", "1GiB"), model("reply", "5GiB", keep_alive="1m"))
        rounds = (0.0, 1000.0, 2000.0, 3000.0)
        trace = reqs(*((name, t + d) for t in rounds for name, d in (("wake", 0.0), ("reply", 2.0))))
        res = replay(cfg, trace, "gdsf", record=True)
        assert res.prewarm_loads == 0
        assert res.cold_starts == 2  # wake and reply, once each (gdsf keeps both: no pressure)


class TestOracle:
    def test_a_request_after_a_long_gap_is_warm(self):
        # chat and img (5 GiB each) cannot share the 9 GiB; chat comes back after 80 minutes.
        cfg = server(model("chat", "5GiB"), model("img", "5GiB"))
        trace = reqs(("chat", 0.0), ("img", 100.0), ("chat", 5000.0))
        res = replay(cfg, trace, "oracle", record=True)
        assert res.served_log is not None and res.actions is not None
        (_, _, cold, _) = res.served_log[-1]  # chat at t=5000 ...
        assert not cold  # ... is warm
        (t_pw, pw), *_ = [(t, a) for t, a in res.actions if a.model == "chat" and a.prewarm and t > 100.0]
        assert pw.kind == ActionKind.PROMOTE  # brought back from host RAM (1 s) ...
        assert 5000.0 - 10.0 <= t_pw < 5000.0  # ... just before it is needed, not at once
        assert res.wasted_loads == 0

    @pytest.mark.parametrize("policy", ["lru-keepalive", "gdsf"])
    def test_online_policies_without_a_forecast_are_cold_there(self, policy):
        cfg = server(model("chat", "5GiB"), model("img", "5GiB"))
        trace = reqs(("chat", 0.0), ("img", 100.0), ("chat", 5000.0))
        res = replay(cfg, trace, policy, record=True)
        assert res.served_log is not None
        assert res.served_log[-1][2]  # chat at t=5000 is a cold start

    @pytest.mark.parametrize(("profile", "seed"), [("home", 1), ("home", 2), ("home", 3), ("studio", 1)])
    def test_no_online_policy_waits_less_than_the_oracle(self, profile, seed):
        cfg = load_config("configs/home.yaml")
        trace = synth(profile, 7, seed)
        oracle = replay(cfg, trace, "oracle")
        assert oracle.budget_violations == 0
        for policy in ONLINE:
            res = replay(cfg, trace, policy)
            assert res.load_wait_s >= oracle.load_wait_s, (policy, res.load_wait_s, oracle.load_wait_s)


@pytest.mark.parametrize("policy", POLICY_NAMES)
class TestPrewarmFlag:
    """`prewarm: false` - "the policy may load it before a predicted request" - holds for all."""

    def test_a_model_with_prewarm_false_is_only_loaded_by_its_requests(self, policy):
        # `nightly` runs every 20 minutes: regular enough for histogram's pre-warm window, known in
        # advance to the oracle, and a start-up preload candidate for residency.
        cfg = server(model("nightly", "2GiB", prewarm=False), model("other", "6GiB"))
        trace = reqs(*(("nightly", 1200.0 * i) for i in range(20)), ("other", 30.0))
        trace.sort(key=lambda r: r.t)
        res = replay(cfg, trace, policy, record=True)
        assert res.actions is not None
        early = [(t, a) for t, a in res.actions if a.model == "nightly" and a.prewarm]
        assert early == []  # never loaded (to GPU or host) ahead of a request


class TestReplayEnds:
    """A policy that keeps asking for wake-ups cannot keep the replay running for ever."""

    def test_endless_wakeups_stop_a_week_after_the_last_request(self):
        from manager.policy.residency import ResidencyPolicy

        class Restless(ResidencyPolicy):
            def prewarm(self, now: float) -> list:  # type: ignore[override]
                self.engine.wakeups.append(now + 60.0)  # every minute, for ever
                return []

        cfg = load_config("configs/home.yaml")
        trace = synth("home", 1, 1)
        sim = Simulator(cfg, trace, "residency")
        sim.engine.policy = Restless()
        sim.engine.policy.bind(sim.engine)
        res = sim.run()  # returns instead of looping
        assert res.served == len(trace)  # and every request was served
