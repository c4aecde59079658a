"""Review 31: editing the config of a running service (hot reload). Found, with reproductions:

- A class reservation added by a reload was not honoured: the lower class's models already in the
  newly reserved room stayed (their explicit keep-alive), and the reserving class (`may_evict:
  false`: its reservation is the only room it gets) waited out its max_wait and was refused; started
  with the same file, it was served at once. Lower classes' idle models now leave the raised
  reservation's room at the reload (`Engine.honour_reservations`).
- A reload answered while the service was still starting loaded the newly pinned models before
  adoption; adoption then found the host holding one, took it for a model that "does not fit the
  books" and dropped it there, while the books kept it on the GPU. The start's own `load_pinned`
  (after adoption) loads them now.
- A reload whose pins left a model no room it could ever have was applied without a word (every
  request for it refused "can never fit" from then on); `config check` warns of it. The reload now
  says so in its reply, the log and a `config_warning` event.
- The reload's wording said a model's `memory` takes effect "at the next restart", but a measured
  footprint holds over it then (`test_reload.py` has the new wording).

Real components: the live manager over in-process device hosts (tiny MLPs; a `cuda` device that runs on
the CPU), config files in tmp_path."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np

from manager.config import Config, load_config
from manager.live import LiveManager
from manager.policy.types import Tier
from manager.workers_bridge import create_pool
from workers.demo import write_tiny_mlp

MiB = 1 << 20
WIDTH = 64
MLP = 2 * (WIDTH * WIDTH + WIDTH) * 4
X = {"input": np.ones((1, WIDTH), dtype=np.float32)}


def write_config(tmp: Path, models: list[tuple[str, str, str]], classes: str, fits: float = 3.5) -> Path:
    """Tiny MLPs (name, class, extra fields) on `gpu0`, room for `fits` of them."""
    path = write_tiny_mlp(tmp / "mlp.safetensors", WIDTH)
    src = f"source: {{factory: 'workers.demo:tiny_mlp', path: '{path}', kwargs: {{width: {WIDTH}}}}}"
    rows = "".join(
        f"  - {{name: {n}, class: {c}, adapter: safetensors-module, device: gpu0, memory: {MLP}, "
        f"load_seconds: {{disk: 0.05, host: 0.01}}{(', ' + x) if x else ''}, {src}}}\n"
        for n, c, x in models
    )
    p = tmp / "c.yaml"
    p.write_text(
        f"devices:\n  - {{name: gpu0, kind: cuda, index: 0, memory: {int(MLP * fits) + MiB}, "
        f"reserve: {MiB}}}\n"
        "host: {memory: 8GiB, reserve: 1GiB}\n"
        f"classes:\n{classes}models:\n{rows}policy: {{name: residency}}\n"
    )
    return p


def pool_for(config: Config) -> Any:
    return create_pool(config, in_process=True, cpu_fallback=frozenset({"gpu0"}))


async def started(config: Config) -> tuple[LiveManager, Any]:
    pool = pool_for(config)
    lm = LiveManager(config, pool)
    await lm.start()
    return lm, pool


def test_a_reservation_raised_by_a_reload_gets_its_room_back(tmp_path: Path) -> None:
    models = [("alarm", "safety", "prewarm: false")] + [
        (f"x{i}", "chat", "prewarm: false, keep_alive: 1h") for i in (1, 2, 3)
    ]
    classes = "  - {name: safety, may_evict: false, max_wait: 3}\n  - {name: chat}\n"
    path = write_config(tmp_path, models, classes)

    async def main() -> None:
        lm, pool = await started(load_config(path))
        try:
            for name in ("x1", "x2", "x3"):  # three chat models fill the device (room for 3.5)
                await lm.infer(name, X, timeout_s=10)
            dev = lm.engine.state.devices["gpu0"]
            assert sum(m.tier == Tier.GPU for m in lm.engine.models.values()) == 3
            path.write_text(path.read_text().replace("max_wait: 3}", f"max_wait: 3, reserve: {MLP}}}"))
            assert lm.reload(load_config(path)) == ["classes.safety.reserve"]
            assert dev.room(1) >= 0  # the chat class is out of the safety class's room
            began = time.monotonic()
            served = await lm.infer("alarm", X, timeout_s=10)
            assert served.result.ok and time.monotonic() - began < 2.5  # not after its max_wait (3 s)
            assert sum(m.tier == Tier.GPU for m in lm.engine.models.values() if m.rank == 1) == 2
        finally:
            await lm.stop()
            pool.close()

    asyncio.run(main())


def test_a_reload_while_the_service_starts_leaves_the_pinned_model_to_adoption(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        [("v", "realtime", "pin: true, keep_alive: forever"), ("x", "interactive", "prewarm: false")],
        "  - {name: realtime}\n  - {name: interactive}\n",
    )
    config = load_config(path)

    async def main() -> None:
        pool = pool_for(config)
        lm = LiveManager(config, pool)
        events = lm.subscribe()
        restore = lm.restore_stats_async

        async def slow_restore() -> int:  # the store's read at start (a slow disk, Redis): 1 s
            await asyncio.sleep(1.0)
            return await restore()

        lm.restore_stats_async = slow_restore  # type: ignore[method-assign]
        try:
            start = asyncio.create_task(lm.start())
            await asyncio.sleep(0.2)
            assert not lm.started
            assert lm.reload(load_config(path)) == []  # as the admin's ReloadConfig calls it
            await start
            for _ in range(100):
                if lm.live["v"].ready.is_set() and not lm.live["v"].loads_pending:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            held = {n: s.tier for n, s in pool.status("gpu0", 5.0).models.items()}
            assert held == {"v": "gpu"} and lm.engine.models["v"].tier == Tier.GPU
            seen = []
            while not events.empty():
                e = events.get_nowait()
                seen.append((e["kind"], e["model"]))
            assert seen.count(("load", "v")) == 1 and ("drop", "v") not in seen
            served = await lm.infer("v", X, timeout_s=10)
            assert not served.cold
        finally:
            await lm.stop()
            pool.close()

    asyncio.run(main())


def test_a_reload_that_leaves_a_model_no_room_says_so(tmp_path: Path) -> None:
    models = [
        ("a", "chat", "prewarm: false"),
        ("b", "chat", "prewarm: false"),
        ("c", "chat", "prewarm: false"),
    ]
    path = write_config(tmp_path, models, "  - {name: chat}\n", fits=2.5)

    async def main() -> None:
        lm, pool = await started(load_config(path))
        events = lm.subscribe()
        try:
            text = path.read_text()
            for name in ("a", "b"):
                text = text.replace(
                    f"name: {name}, class: chat, adapter: safetensors-module,",
                    f"name: {name}, class: chat, pin: true, adapter: safetensors-module,",
                )
            path.write_text(text)
            changes = lm.reload(load_config(path))
            assert changes == ["models.a.pin", "models.b.pin"]  # applied: the file says so
            (warning,) = lm.reload_warnings
            assert warning.startswith("model 'c' can never be served now: ") and lm.engine.never_fits["c"]
            seen = []
            while not events.empty():
                e = events.get_nowait()
                seen.append((e["kind"], e["model"], e["detail"]))
            assert ("config_warning", "c", warning) in seen
            path.write_text(text.replace("name: b, class: chat, pin: true,", "name: b, class: chat,"))
            assert lm.reload(load_config(path)) == ["models.b.pin"]
            assert lm.reload_warnings == []  # room for it again: nothing to say
        finally:
            await lm.stop()
            pool.close()

    asyncio.run(main())


def test_a_reload_that_raises_no_reservation_evicts_nothing(tmp_path: Path) -> None:
    """Two top-class models take a middle class's reserved room (a higher class may) after two low ones
    loaded: the low class is then in that room. A reload of the same file (a touch the watcher sees,
    the tuning's auto-apply) raised no reservation: nothing is evicted (`honour_reservations` gives
    back only what a raise took)."""
    models = [
        (n, c, "prewarm: false, keep_alive: 1h")
        for n, c in (("t1", "top"), ("t2", "top"), ("x1", "low"), ("x2", "low"))
    ]
    classes = f"  - {{name: top}}\n  - {{name: mid, reserve: {2 * MLP}}}\n  - {{name: low}}\n"
    path = write_config(tmp_path, models, classes, fits=5.0)

    async def main() -> None:
        lm, pool = await started(load_config(path))
        try:
            for name in ("x1", "x2", "t1", "t2"):
                await lm.infer(name, X, timeout_s=10)
            dev = lm.engine.state.devices["gpu0"]
            on_gpu = sorted(n for n, m in lm.engine.models.items() if m.tier == Tier.GPU)
            assert on_gpu == ["t1", "t2", "x1", "x2"] and dev.room(2) < 0  # (the low class in mid's room)
            evictions = lm.engine.counters.evictions
            assert lm.reload(load_config(path)) == []
            assert lm.engine.counters.evictions == evictions
            assert sorted(n for n, m in lm.engine.models.items() if m.tier == Tier.GPU) == on_gpu
        finally:
            await lm.stop()
            pool.close()

    asyncio.run(main())


GiB = 1 << 30


def _engine(models: list[tuple[str, str]]) -> Any:
    from manager.config import Config as Cfg
    from manager.policy.engine import Engine
    from manager.policy.factory import create_policy

    cfg = Cfg.model_validate(
        {
            "devices": [{"name": "gpu0", "kind": "cuda", "memory": "10GiB", "reserve": 0}],
            "host": {"memory": "24GiB", "reserve": "4GiB"},
            "classes": [{"name": "top"}, {"name": "mid"}, {"name": "low"}],
            "models": [
                {
                    "name": n,
                    "class": c,
                    "adapter": "test",
                    "device": "gpu0",
                    "prewarm": False,
                    "memory": "1GiB",
                    "load_seconds": {"disk": 1.0, "host": 0.5},
                }
                for n, c in models
            ],
            "policy": {"name": "residency", "min_residency": 0},
        }
    )
    engine = Engine(cfg, create_policy("residency"))
    engine.start(0.0)
    return engine


def _serve(engine: Any, name: str, now: float) -> None:
    m = engine.models[name]
    engine.observe(m, now)
    admission = engine.admit(m, m.rank, now)
    assert admission.status in ("hit", "load"), admission
    engine.finish(m, max(now, admission.ready_at), 0.1)


def test_a_raise_gives_back_what_it_withholds_anew_and_no_more() -> None:
    """(A review of the first fix: it gave back the raise's whole growth, for each class below it.)"""
    # the top class uses 2 GiB already; its reservation goes 0 -> 3 GiB: 1 GiB more is withheld
    engine = _engine([("t1", "top"), ("t2", "top")] + [(f"l{i}", "low") for i in range(8)])
    dev = engine.state.devices["gpu0"]
    dev.reserves[:] = [0, 2 * GiB, 0]  # (a middle class's reservation the top class took before)
    for i, name in enumerate([f"l{i}" for i in range(8)] + ["t1", "t2"]):
        _serve(engine, name, 1.0 + i)
    before = {"gpu0": list(dev.reserves)}
    dev.reserves[:] = [3 * GiB, 2 * GiB, 0]
    evictions = engine.counters.evictions
    engine.honour_reservations(100.0, before)
    assert engine.counters.evictions - evictions == 1  # 1 GiB: not 3 (the raise), nor the older 2
    # a shortfall older than the reload (top's 3 GiB reservation unused, low models in it); the
    # reservation goes 3 -> 4 GiB: one model's room is owed, once, whatever the classes below it
    engine = _engine([("t1", "top"), ("m1", "mid")] + [(f"l{i}", "low") for i in range(9)])
    dev = engine.state.devices["gpu0"]
    for i in range(9):
        _serve(engine, f"l{i}", 1.0 + i)
    _serve(engine, "m1", 20.0)
    dev.reserves[:] = [3 * GiB, 0, 0]
    before = {"gpu0": list(dev.reserves)}
    dev.reserves[:] = [4 * GiB, 0, 0]
    evictions = engine.counters.evictions
    engine.honour_reservations(100.0, before)
    assert engine.counters.evictions - evictions == 1
