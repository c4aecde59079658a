"""Hot config reload: tunable fields apply in place; structural changes need a restart."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from manager.config import Config, load_config
from manager.live import LiveManager
from manager.reload import RestartNeeded, plan_reload
from manager.workers_bridge import create_pool

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-cpu.yaml"
HOME = Path(__file__).resolve().parents[2] / "configs" / "home.yaml"


def edited(base: Config, model: str, **fields: object) -> Config:
    models = [m.model_copy(update=fields) if m.name == model else m for m in base.models]
    return base.model_copy(update={"models": models})


def test_tunable_changes_are_listed() -> None:
    base = load_config(HOME)
    new = edited(base, "llm", keep_alive=900, prewarm=False)
    classes = [c.model_copy(update={"reserve": 2**30}) if c.name == "realtime" else c for c in base.classes]
    new = new.model_copy(
        update={"classes": classes, "policy": base.policy.model_copy(update={"thrash_window": 60})}
    )
    assert plan_reload(base, new) == [
        "models.llm.keep_alive",
        "models.llm.prewarm",
        "classes.realtime.reserve",
        "policy.thrash_window",
    ]
    assert plan_reload(base, base) == []


def test_changes_that_seed_measurements_are_said_to_wait_for_a_restart() -> None:
    """A model's memory and load seconds seed what the service measures; a reload does not apply them
    (the books hold the measured footprint). They were listed as applied."""
    base = load_config(HOME)
    llm = next(m for m in base.models if m.name == "llm")
    new = edited(base, "llm", memory=llm.memory + 2**20)
    assert plan_reload(base, new) == ["models.llm.memory (at the next restart, unless measured)"]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda c: edited(c, "llm", device="gpu1"), "model 'llm': device changed"),
        (lambda c: edited(c, "llm", adapter="torchscript"), "model 'llm': adapter changed"),
        (lambda c: edited(c, "embed", max_batch=8), "model 'embed': max_batch changed"),
        (lambda c: c.model_copy(update={"models": c.models[:-1]}), r"removed \['photos'\]"),
        (
            lambda c: c.model_copy(update={"policy": c.policy.model_copy(update={"name": "gdsf"})}),
            "policy changed",
        ),
        (lambda c: c.model_copy(update={"classes": list(reversed(c.classes))}), "class names"),
    ],
)
def test_structural_changes_need_a_restart(change: object, words: str) -> None:
    base = load_config(HOME)
    with pytest.raises(RestartNeeded, match=words):
        plan_reload(base, change(base))  # type: ignore[operator]


def test_reload_applies_in_place_without_dropping_requests() -> None:
    config = load_config(CONFIG)

    async def main() -> None:
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool)
        events = lm.subscribe()
        await lm.start()
        try:
            inflight = asyncio.create_task(lm.infer("embed", {"text": np.array([b"x"], dtype=object)}))
            changes = lm.reload(edited(config, "embed", pin=True, keep_alive=120))
            assert changes == ["models.embed.keep_alive", "models.embed.pin"]
            assert (await inflight).result.ok  # the request in flight is served
            m = lm.engine.models["embed"]
            assert m.pinned and m.keep_alive_cfg == 120 and lm.config.models[2].pin
            kinds = []
            while not events.empty():
                kinds.append(events.get_nowait()["kind"])
            assert "config_reloaded" in kinds
        finally:
            await lm.stop()
            pool.close()

    asyncio.run(main())


def test_a_reload_works_out_again_which_models_can_never_fit() -> None:
    # home.yaml: 22.5 GiB usable. A realtime reservation of 14 GiB leaves the interactive class at
    # most 8.5 GiB, less than the LLM's 9 GiB: from that reload on the LLM is rejected with the reason,
    # and the reload back makes it loadable again (before, the check from start-up stood).
    from manager.policy.engine import Engine
    from manager.policy.factory import create_policy
    from manager.reload import apply_reload

    base = load_config(HOME)
    big = [c.model_copy(update={"reserve": 14 * 2**30}) if c.name == "realtime" else c for c in base.classes]
    tight = base.model_copy(update={"classes": big})
    engine = Engine(base, create_policy("lru-keepalive"))
    engine.start(0.0)
    llm = engine.models["llm"]
    apply_reload(engine, tight)
    adm = engine.admit(llm, llm.rank, 10.0)
    assert adm.status == "reject" and "can never give it more than 8.5GiB" in adm.reason
    apply_reload(engine, base)
    assert engine.admit(llm, llm.rank, 20.0).status == "load"


def test_pins_that_overfill_a_device_give_reasons_not_a_crash() -> None:
    # An admin may try to pin more than a device holds (the live manager then refuses the pin): the
    # engine's verdict says so in bytes instead of failing to print a negative room (a ValueError
    # escaped from an admin Pin, found by a chaos run).
    from manager.policy.engine import Engine
    from manager.policy.factory import create_policy

    engine = Engine(load_config(HOME), create_policy("lru-keepalive"))
    for name in ("llm", "image", "world", "photos"):  # 9 + 7 + 5 + 2.5 GiB pinned, 22.5 usable
        engine.models[name].pinned = True
    engine.recheck_fit()
    assert "can never give it more than 0B" in engine.never_fits["tts"]  # 0.9 GiB, nothing left
    assert "needs 9GiB" in engine.never_fits["llm"]


def test_settings_read_at_start_are_listed_and_host_memory_needs_a_restart() -> None:
    """A reload said "no changes" for a new admin token variable or tuning schedule, which it did
    not apply, and took a new host RAM budget on paper while the books kept the old one."""
    base = load_config(HOME)
    server = base.server.model_copy(update={"auth_token_env": "ADMIN_TOKEN"})
    tuning = base.tuning.model_copy(update={"schedule": "daily", "apply": "auto"})
    new = base.model_copy(update={"server": server, "tuning": tuning})
    assert plan_reload(base, new) == [
        "tuning.apply",
        "server.auth_token_env (at the next restart)",
        "tuning.schedule (at the next restart)",
    ]
    host = base.model_copy(update={"host": base.host.model_copy(update={"memory": base.host.memory // 2})})
    with pytest.raises(RestartNeeded, match="host memory"):
        plan_reload(base, host)
