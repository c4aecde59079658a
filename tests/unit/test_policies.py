"""One narrated scenario per policy, showing the behaviour that defines it.

- lru-keepalive (Ollama): a fixed 5-minute keep-alive whatever the config says, then unloaded;
  at most 3 models per device; ties broken by name.
- histogram (Serverless in the Wild): with few samples, the default keep-alive; with a learned
  histogram, its own keep-alive window.
- gdsf: evicts the lowest H = L + cost x freq / size: a cheap-to-reload, large, rarely used model
  goes first, however recently it was used.
- residency: demotes victims to host RAM, prewarms a learned successor (A, then B seconds
  later) as soon as A is requested, and lets two models in use take turns on a room too small for
  both; a guess never makes a request wait; sparse hourly rates are not read as "never".
- oracle: prewarms just in time, so a request after a long gap is warm; on the shipped traces no
  online policy waits less for loads than it does.

The server is small and hand-built: one cuda device with 9 GiB usable (10 GiB, 1 GiB reserve),
one class unless said otherwise, 12 GiB of host RAM for the host tier and the page cache.
"""

from __future__ import annotations

import math
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


def take_turns(sc: Any, rounds: int) -> float:
    """chat, then img 20 s later, then chat, ... (each busy 5 s, ticked once its request ended: at
    most 1 s of load + 5 s); returns the time of the next turn."""
    t = 0.0
    for _ in range(rounds):
        for name in ("chat", "img"):
            assert sc.request(name, t, busy=5.0).status in ADMITTED
            sc.tick(t + 10.0)
            t += 20.0
    return t


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

    def test_models_in_use_take_turns_on_a_shared_room(self, drive):
        # chat and img (5 GiB each) cannot share the 9 GiB, and someone uses both in turn: chat, then
        # img 20 s later, then chat, ... (each 5 s). Once the policy has seen a few turns, the end of
        # chat's request swaps img in from host RAM, so img's request finds it warm; and back.
        cfg = server(model("chat", "5GiB"), model("img", "5GiB"))
        sc = drive(cfg, "residency")
        sc.start()
        t = take_turns(sc, rounds=4)  # learning: every request after chat is img and after img is chat
        sc.clear()
        assert sc.request("chat", t, busy=5.0).status == "hit"  # chat came back at the last turn
        sc.tick(t + 10.0)  # chat's request ended: its turn is over
        assert sc.tier("img") == Tier.GPU and sc.tier("chat") == Tier.HOST
        promote = [a for _, a in sc.actions if a.model == "img"]
        assert [(a.kind, a.prewarm) for a in promote] == [(ActionKind.PROMOTE, True)]
        assert sc.request("img", t + 20.0, busy=5.0).status == "hit"  # warm when it is asked for

    def test_no_turn_is_taken_for_a_model_not_in_use(self, drive):
        # The same pair, but img was last asked for an hour ago and chat keeps being asked alone:
        # after chat's requests img stays in host RAM (the next request is chat again).
        cfg = server(model("chat", "5GiB"), model("img", "5GiB"))
        sc = drive(cfg, "residency")
        sc.start()
        assert sc.request("img", 0.0).status == "load"
        for i in range(6):
            t = 3600.0 + 60.0 * i
            assert sc.request("chat", t, busy=5.0).status in ADMITTED
            sc.tick(t + 10.0)
            assert sc.tier("chat") == Tier.GPU and sc.tier("img") == Tier.HOST

    def test_a_guess_gives_way_to_a_request(self, drive):
        # A turn-taking swap prewarmed img; before img is asked for, doc (5 GiB) is: doc does not
        # wait for img's min_residency (a guess never makes a request wait), img goes to host RAM.
        cfg = server(model("chat", "5GiB"), model("img", "5GiB"), model("doc", "5GiB"))
        sc = drive(cfg, "residency")
        sc.start()
        t = take_turns(sc, rounds=4)
        sc.request("chat", t, busy=5.0)
        sc.tick(t + 10.0)
        assert sc.tier("img") == Tier.GPU and sc.m("img").prewarmed  # swapped in, not used yet
        adm = sc.request("doc", t + 11.0)  # 1 s later: well within the 1-minute min_residency
        assert adm.status == "load"
        assert sc.tier("img") == Tier.HOST and sc.tier("doc") == Tier.GPU

    def test_with_statistics_boot_preloads_the_likeliest(self, drive):
        # Only one of the two fits. After a restart with statistics (here: arrivals seen before the
        # start), `used` was asked for every 10 minutes, so it is worth more on the GPU than
        # `costly`, which nobody has asked for, though its miss costs twice as much and it is listed
        # first. (On a first boot, with nothing known, the config's order stands.)
        cfg = server(model("costly", "5GiB", host=1.0), model("used", "5GiB", host=0.5))
        sc = drive(cfg, "residency")
        for i in range(18):
            sc.engine.observe(sc.m("used"), -3 * 3600.0 + 600.0 * i)
        sc.start(-60.0)
        assert sc.tier("used") == Tier.GPU and sc.tier("costly") == Tier.HOST

    def test_a_displaced_model_comes_back_when_its_hour_comes_round(self, drive):
        # img is busy every afternoon at 14:00. On day 1 a world session at 20:00 pushes it to host
        # RAM; when the session ends, img is not likely before its next afternoon, so it stays there.
        # The hourly review at the first request after 14:00 on day 2 (any model's: here `clock`)
        # promotes img back, displacing the idle world model, before img is asked for.
        H, D = 3600.0, 86400.0
        cfg = server(model("world", "5GiB"), model("img", "5GiB"), model("clock", "1GiB"))
        sc = drive(cfg, "residency")
        sc.start()
        for i in range(12):  # day 1, 14:00-14:55: img every 5 minutes
            assert sc.request("img", 14 * H + 300.0 * i, busy=10.0).status in ADMITTED
        assert sc.request("world", 20 * H, busy=H).status == "load"
        assert sc.tier("img") == Tier.HOST  # the session needed its room
        sc.tick(21 * H)  # the session ended: img is not worth restoring at night
        assert sc.tier("img") == Tier.HOST and sc.tier("world") == Tier.GPU
        for t in (D + 9 * H, D + 13.5 * H):  # day 2, morning: still not img's hour
            assert sc.request("clock", t).status in ADMITTED
            assert sc.tier("img") == Tier.HOST
        sc.clear()
        assert sc.request("clock", D + 14 * H + 120.0).status in ADMITTED  # 14:02: the review
        assert sc.tier("img") == Tier.GPU and sc.tier("world") == Tier.HOST
        img_moves = [(a.kind, a.prewarm) for _, a in sc.actions if a.model == "img"]
        assert img_moves == [(ActionKind.PROMOTE, True)]
        assert sc.request("img", D + 14 * H + 600.0, busy=10.0).status == "hit"  # warm at 14:10

    def test_an_hour_without_arrivals_yet_is_not_taken_for_never(self):
        # In its first days a model's hour-of-day counts are sparse: `daily` was asked for at 08:00
        # only. At 20:00 its hour has no arrival yet, but the model is used every day: P > 0.
        from manager.policy.engine import Engine
        from manager.policy.residency import HORIZON_S, RATE_SMOOTH, ResidencyPolicy

        cfg = server(model("daily", "2GiB"))
        eng = Engine(cfg, ResidencyPolicy())
        monday = 1793577600.0  # Monday 2026-11-02 00:00 (wall clock as UTC)
        eng.start(monday)
        m = eng.models["daily"]
        for day in range(3):
            eng.observe(m, monday + day * 86400.0 + 8 * 3600.0)
        pol = eng.policy
        assert isinstance(pol, ResidencyPolicy)
        assert m.hist.rate_per_hour(monday + 2 * 86400.0 + 20 * 3600.0, 3 / 7) == 0.0  # the hour alone
        # Shrunk towards the mean: 3 arrivals in the 68 h since start; half of P comes from the rate.
        rate = RATE_SMOOTH * 3 / 68.0
        expected = 0.5 * (1.0 - math.exp(-rate * HORIZON_S / 3600.0))
        assert pol.p_request(m, monday + 2 * 86400.0 + 20 * 3600.0) == pytest.approx(expected)
        assert expected > 0.003

    def test_restored_statistics_are_not_read_as_one_busy_day(self):
        # A restarted manager restores a week of arrivals (the store kept them). Its rates are per
        # hour over the whole time the statistics cover, not over the minutes since the restart.
        from manager.policy.engine import Engine
        from manager.policy.residency import ResidencyPolicy

        cfg = server(model("daily", "2GiB"))
        monday = 1793577600.0
        week = [monday + day * 86400.0 + 8 * 3600.0 for day in range(7)]
        now = monday + 7 * 86400.0 + 8.5 * 3600.0  # next Monday, 08:30 (no arrival yet today)
        before = Engine(cfg, ResidencyPolicy())
        before.start(monday - 600.0)
        for t in week:
            before.observe(before.models["daily"], t)
        after = Engine(cfg, ResidencyPolicy())
        after.start(now - 60.0)  # restarted a minute ago
        after.models["daily"].hist.restore(before.models["daily"].hist.capture())
        after.models["daily"].last_arrival = week[-1]
        p_before = before.policy.p_request(before.models["daily"], now)  # type: ignore[attr-defined]
        p_after = after.policy.p_request(after.models["daily"], now)  # type: ignore[attr-defined]
        assert p_before > 0.1  # the hour of Monday 08:00 saw one arrival in one week
        assert p_after == pytest.approx(p_before, rel=0.1)  # (read as 7 in one day, P would be ~0.46)


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
