"""The live manager keeps what a device host really holds within its budget, in time as well as in its books.

Found by the memory soak (bench/soak.py): (1) a model whose load was not confirmed yet, with a request
waiting for it, passed its keep-alive (the engine's load estimate had long gone by) and was demoted
under the request, which then slept until its deadline; (2) a load was submitted before the world
session had applied the shrunk lease that made its room, so for a moment the device held the old
lease and the new model; and a grown lease could be applied before the drop that freed its room.
Real models (tiny_mlp stand-in, WorldPager's MG2-shaped stand-in at its "micro" size) on in-process
hosts; a pool wrapper only delays results or resizes, as a busy host or a long step does."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from live_helpers import run

from manager.config import load_config
from manager.errors import DeadlineExceeded, InsufficientCapacity, InvalidRequest
from manager.live import LiveManager
from manager.policy.types import Tier
from manager.workers_bridge import create_pool
from workers import protocol as P
from workers.demo import write_tiny_mlp

WIDTH = 512
MLP_BYTES = 2 * (WIDTH * WIDTH + WIDTH) * 4  # tiny_mlp's two fp32 Linear layers
CONFIG = """
devices:
  - {{name: cpu0, kind: cpu, memory: 1GiB, reserve: 128MiB}}
host: {{memory: 8GiB, reserve: 1GiB}}
classes:
  - {{name: interactive}}
  - {{name: background, may_evict: false}}
models:
  - {{name: world, class: interactive, adapter: worldpager-mg2, device: cpu0, memory: 4MiB,
     elastic: {{min: 16MiB, max: 900MiB}}, load_seconds: {{disk: 0.2, host: 0.05}}, keep_alive: 10m,
     source: {{preset: micro}}}}
  - {{name: mlp, class: background, adapter: safetensors-module, device: cpu0, memory: {mlp_bytes},
     load_seconds: {{disk: 0.05, host: 0.01}}, keep_alive: 1s, prewarm: false,
     source: {{factory: "workers.demo:tiny_mlp", path: "{path}", kwargs: {{width: {width}}}}}}}
policy: {{name: residency, min_residency: 0.5s}}
"""
X = {"input": np.ones((1, WIDTH), dtype=np.float32)}


class Recording:
    """An in-process pool that records, in order, what reaches the device host and what comes back;
    it can hold back `Load`/`Demote` results of one model (a busy host) and slow session resizes
    (a resize waits for the step that holds the session's lock)."""

    def __init__(self, inner: Any, *, hold: dict[str, float] | None = None, resize_s: float = 0.0) -> None:
        self.inner = inner
        self.hold = hold or {}  # "model:op" -> seconds its results are held back
        self.resize_s = resize_s
        self.log: list[tuple[str, ...]] = []
        self._held: list[tuple[float, P.CommandResult]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _note(self, *what: str) -> None:
        with self._lock:
            self.log.append(what)

    def submit(self, device: str, cmd: P.Command, op_id: str | None = None) -> str:
        model = cmd.model.name if isinstance(cmd, P.Load) else cmd.model  # type: ignore[union-attr]
        self._note("submit", type(cmd).__name__, model)
        return str(self.inner.submit(device, cmd, op_id))

    def poll(self) -> list[P.CommandResult]:
        now = time.monotonic()
        for r in self.inner.poll():
            self._held.append((now + self.hold.get(f"{r.model}:{r.op}", 0.0), r))
        out = [r for t, r in self._held if t <= now]
        self._held = [(t, r) for t, r in self._held if t > now]
        for r in out:
            self._note("result", r.op, r.model)
        return out

    def session(self, device: str, method: str, *args: Any, timeout_s: float = 120.0) -> P.SessionReply:
        if method == "resize":
            self._note("resize-start", str(args[1]))
            time.sleep(self.resize_s)
        reply: P.SessionReply = self.inner.session(device, method, *args, timeout_s=timeout_s)
        if method == "resize":
            self._note("resize-done", str(reply.data.get("lease_bytes")))
        return reply


def setup(tmp_path: Path, *, sessions: bool = False, world_keep_alive: str = "10m") -> Any:
    """The config above; `sessions`: saved world sessions under `tmp_path` (not the default folder)."""
    path = write_tiny_mlp(tmp_path / "mlp.safetensors", WIDTH)
    cfg = tmp_path / "c.yaml"
    text = CONFIG.format(mlp_bytes=MLP_BYTES, path=path, width=WIDTH)
    text = text.replace("keep_alive: 10m", f"keep_alive: {world_keep_alive}")
    cfg.write_text(text + (f"store: {{sessions: '{tmp_path / 'sessions'}'}}\n" if sessions else ""))
    return load_config(cfg)


async def until(cond: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_a_model_with_a_waiting_request_is_not_expired_while_its_load_is_unconfirmed(tmp_path: Path) -> None:
    config = setup(tmp_path)

    async def main() -> None:
        # the host confirms mlp's load 3 s late: well past its estimate (0.05 s) and keep-alive (1 s)
        pool = Recording(create_pool(config, in_process=True), hold={"mlp:load": 3.0})
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            served = await lm.infer("mlp", X, timeout_s=15)
            assert served.result.ok and served.cold
            assert served.result.outputs["output"][1] == (1, WIDTH)
            moves = [e for e in pool.log if e[0] == "submit" and e[2] == "mlp"]
            assert moves == [("submit", "Load", "mlp")]  # loaded once, never demoted under the request
            assert lm.engine.models["mlp"].waiting == 0
            await until(lambda: lm.engine.counters.expiries == 1)  # afterwards its keep-alive applies
        finally:
            await lm.stop()
            pool.close()
        assert lm.engine.counters.thrash == 0 and lm.engine.counters.budget_violations == 0

    asyncio.run(main())


def test_a_load_waits_for_the_shrunk_lease_and_a_grown_lease_for_the_freed_room(tmp_path: Path) -> None:
    config = setup(tmp_path)

    async def main() -> None:
        # a resize takes 0.5 s (a step holds the session); mlp's demote is confirmed 1 s late
        pool = Recording(create_pool(config, in_process=True), hold={"mlp:demote": 1.0}, resize_s=0.5)
        lm = LiveManager(config, pool)
        await lm.start()
        world = lm.engine.models["world"]
        try:
            sid, _ = await lm.open_session("world")
            await lm.step_session(sid, (0.0, 0.0, 0.0, 0.0, 0.0))
            await until(lambda: world.lease > 500 * 2**20 and ("resize-done", str(world.lease)) in pool.log)
            grown = world.lease
            pool.log.clear()
            served = await lm.infer("mlp", X, timeout_s=15)  # a background request takes lease room back
            assert served.result.ok and world.lease < grown
            small = world.lease
            log = list(pool.log)
            load = log.index(("submit", "Load", "mlp"))
            shrunk = log.index(("resize-done", str(world.lease)))
            assert log.index(("resize-start", str(world.lease))) < shrunk < load
            # mlp's keep-alive passes: it is demoted, and only then does the lease grow back
            await until(
                lambda: world.lease >= grown - 2**20 and ("resize-done", str(world.lease)) in pool.log
            )
            log = list(pool.log)
            demoted = log.index(("result", "demote", "mlp"))
            regrow = [i for i, e in enumerate(log) if e[0] == "resize-start" and int(e[1]) > small]
            assert regrow and all(demoted < i for i in regrow)
            assert log.index(("submit", "Demote", "mlp")) < demoted
            await lm.close_session(sid)
        finally:
            await lm.stop()
            pool.close()
        c = lm.engine.counters
        assert c.thrash == 0 and c.budget_violations == 0 and c.lease_shrinks >= 1 and c.lease_grows >= 2

    asyncio.run(main())


def test_a_request_whose_model_is_evicted_during_its_load_says_why_it_timed_out(tmp_path: Path) -> None:
    # Found by a chaos run (random requests, pins, evicts and preloads): a request waiting for its
    # model's load, when an admin evicted the model and another took the room, timed out saying
    # the model "did not finish loading" - it was waiting for room, not for a load. (Since 2026-12-04
    # an admin's evict waits for the requests waiting for the load; a resync that finds the device
    # host no longer holds the model, `_off_books`, still takes it off under the request.)
    path = write_tiny_mlp(tmp_path / "mlp.safetensors", WIDTH)

    def entry(name: str, cls: str, load_s: float, pin: bool) -> str:
        return (
            f"  - {{name: {name}, class: {cls}, adapter: safetensors-module, device: cpu0, "
            f"memory: {MLP_BYTES}, load_seconds: {{disk: 0.05, host: 0.01}}, prewarm: false, "
            f"pin: {str(pin).lower()}, source: {{factory: 'workers.demo:slow_mlp', path: '{path}', "
            f"kwargs: {{width: {WIDTH}, load_s: {load_s}, infer_s: 0.0}}}}}}"
        )

    models = entry("batch", "background", 1.0, False) + "\n" + entry("chat", "interactive", 0.0, True)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"devices:\n  - {{name: cpu0, kind: cpu, memory: {int(MLP_BYTES * 1.5) + 2**20}, "
        f"reserve: {2**20}}}\n"
        "host: {memory: 8GiB, reserve: 1GiB}\n"
        "classes:\n  - {name: interactive}\n  - {name: background, may_evict: false}\n"
        f"models:\n{models}\npolicy: {{name: residency, min_residency: 0}}\n"
    )
    config = load_config(cfg)  # the device holds one of the two; chat is pinned but not loaded yet

    async def body(lm: LiveManager) -> None:
        assert lm.engine.models["chat"].tier == Tier.GPU  # a pinned model is loaded at start
        lm.set_pin("chat", False)
        lm.evict("chat")
        request = asyncio.create_task(lm.infer("batch", X, timeout_s=3.0))
        await until(lambda: lm.engine.models["batch"].tier == Tier.GPU)  # its load (1 s) begins
        lm.evict("batch")  # an admin's evict waits for the request waiting for the load
        assert lm.live["batch"].evict_to == "disk" and lm.engine.models["batch"].tier == Tier.GPU
        lm.live["batch"].evict_to = None
        lm._off_books(lm.engine.models["batch"], "test: the device host no longer holds it")
        await lm.preload("chat")  # and chat takes the room; a background request may not evict
        with pytest.raises(DeadlineExceeded, match="taken off its device while the request waited"):
            await request

    run(config, body)


def one_of_two(tmp_path: Path, *, chat_pinned: bool, device_models: float = 1.5) -> Any:
    """Two interactive tiny MLPs, chat and other, on a cpu device that holds `device_models` of them."""
    path = write_tiny_mlp(tmp_path / "mlp.safetensors", WIDTH)
    src = f"source: {{factory: 'workers.demo:tiny_mlp', path: '{path}', kwargs: {{width: {WIDTH}}}}}"
    models = "".join(
        f"  - {{name: {name}, class: interactive, adapter: safetensors-module, device: cpu0, "
        f"memory: {MLP_BYTES}, load_seconds: {{disk: 0.05, host: 0.01}}, prewarm: false, pin: {pin}, "
        f"{src}}}\n"
        for name, pin in (("chat", str(chat_pinned).lower()), ("other", "false"))
    )
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"devices:\n  - {{name: cpu0, kind: cpu, memory: {int(MLP_BYTES * device_models) + 2**20}, "
        f"reserve: {2**20}}}\nhost: {{memory: 8GiB, reserve: 1GiB}}\nclasses:\n  - {{name: interactive}}\n"
        f"models:\n{models}policy: {{name: residency, min_residency: 0}}\n"
    )
    return load_config(cfg)


def test_an_admin_unpin_lets_a_model_that_could_never_fit_be_served(tmp_path: Path) -> None:
    # The device holds one of the two models. While chat is pinned, other can never be loaded and is
    # rejected with the reason; once an admin unpins chat, other is served (chat makes room). Before,
    # the verdict worked out at start-up stood until a restart.
    config = one_of_two(tmp_path, chat_pinned=True)

    async def body(lm: LiveManager) -> None:
        with pytest.raises(InsufficientCapacity, match="can never give it more than"):
            await lm.infer("other", X, timeout_s=5.0)
        lm.set_pin("chat", False)
        served = await lm.infer("other", X, timeout_s=5.0)
        assert served.result.ok and lm.engine.models["chat"].tier != Tier.GPU
        lm.set_pin("chat", True)  # pinned again (on the host tier now): other cannot be loaded
        assert "can never" in lm.engine.never_fits["other"]

    run(config, body)


def test_an_admin_pin_is_refused_when_the_pins_would_not_fit_together(tmp_path: Path) -> None:
    config = one_of_two(tmp_path, chat_pinned=True)  # chat is pinned; the device holds one of two

    async def body(lm: LiveManager) -> None:
        with pytest.raises(InvalidRequest, match="cannot pin 'other': the pinned models would no longer fit"):
            lm.set_pin("other", True)
        assert not lm.engine.models["other"].pinned and lm.pin_overrides == {}
        assert lm.engine.never_fits["chat"] == ""  # chat's own verdict is back as it was

    run(config, body)


def test_an_admin_pin_loads_the_model_into_free_room(tmp_path: Path) -> None:
    config = one_of_two(tmp_path, chat_pinned=False, device_models=2.5)  # room for both

    async def body(lm: LiveManager) -> None:
        pool = lm.pool
        other = lm.engine.models["other"]
        assert other.tier != Tier.GPU  # prewarm: false, nothing asked for it
        lm.set_pin("other", True)
        assert other.tier == Tier.GPU  # on the books at once, and on the device once confirmed
        await until(lambda: "other" in pool.status("cpu0").models)
        assert pool.status("cpu0").models["other"].tier == "gpu"

    run(config, body)


class SlowToStart(Recording):
    """A pool whose inferences start `delay_s` late (a busy thread pool, a GIL-bound host)."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        super().__init__(inner)
        self.delay_s = delay_s

    def infer(self, device: str, model: str, inputs: Any, timeout_s: float) -> Any:
        time.sleep(self.delay_s)
        self._note("infer", model)
        return self.inner.infer(device, model, inputs, timeout_s)


async def evicted_in_flight(lm: LiveManager) -> asyncio.Task[Any]:
    """A request for "other" (preloaded), and an admin's evict to host RAM while it is in flight."""
    await lm.preload("other")
    request = asyncio.create_task(lm.infer("other", X, timeout_s=10.0))
    await until(lambda: lm.live["other"].inflight == 1)
    lm.evict("other", "host")
    return request


def test_an_admin_evict_waits_for_the_requests_in_flight(tmp_path: Path) -> None:
    # Found by a chaos run: an evict that came after a request was admitted but before its device
    # host ran it dropped the model under it; the request failed ("not resident"), or loaded it again.
    # Now the evict waits for the requests in flight, as Triton's unload and Ollama's stop do.
    config = one_of_two(tmp_path, chat_pinned=False, device_models=2.5)

    async def body(lm: LiveManager) -> None:
        pool = lm.pool
        request = await evicted_in_flight(lm)
        assert lm.engine.models["other"].tier == Tier.GPU  # not yet
        served = await request
        assert served.result.ok and not served.cold
        assert lm.engine.models["other"].tier == Tier.HOST  # then it went
        moves = [e for e in pool.log if e[-1] == "other" and e[0] in ("submit", "infer")]
        assert moves == [("submit", "Load", "other"), ("infer", "other"), ("submit", "Demote", "other")]

    run(config, body, wrap=lambda p: SlowToStart(p, delay_s=0.5))


class SlowSessions(Recording):
    """A pool whose device host takes `delays[method]` seconds to open or close a world session (a
    cold codec, a slow disk); a method in `gate` instead waits, once `entered` says it is on the host,
    until the test sets `go` (so that a test acts while it runs, however slow the machine)."""

    def __init__(self, inner: Any, gate: tuple[str, ...] = (), **delays: float) -> None:
        super().__init__(inner)
        self.delays = delays
        self.gate = gate
        self.entered = threading.Event()
        self.go = threading.Event()

    def session(self, device: str, method: str, *args: Any, timeout_s: float = 120.0) -> P.SessionReply:
        if method in self.gate:
            self.entered.set()
            assert self.go.wait(60), f"the test never let the held {method} go"
        time.sleep(self.delays.get(method, 0.0))
        reply = super().session(device, method, *args, timeout_s=timeout_s)
        self._note("session", method, str(args[1] if method == "open" else args[0]))
        return reply


def _releasing(body: Callable[[LiveManager], Awaitable[None]]) -> Callable[[LiveManager], Awaitable[None]]:
    """`body`, after which its SlowSessions' gated call is let go whatever happened (a failed
    assertion is then said at once, not after the stop waited for the held call)."""

    async def released(lm: LiveManager) -> None:
        try:
            await body(lm)
        finally:
            lm.pool.go.set()  # type: ignore[attr-defined]

    return released


def test_a_session_open_cancelled_by_its_client_leaves_nothing_open_or_busy(tmp_path: Path) -> None:
    # A client that hung up while the device host opened its world session (the RPC's task is
    # cancelled) left the world model busy for good (never evicted, its evicts deferred forever),
    # and the session open on the host, holding its KV lease, with nobody to close it.
    config = setup(tmp_path)

    async def body(lm: LiveManager) -> None:
        pool, world = lm.pool, lm.engine.models["world"]
        opening = asyncio.create_task(lm.open_session("world"))
        await until(pool.entered.is_set)  # the host is opening it
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening
        with pytest.raises(InsufficientCapacity, match=r"runs a session \(opening\)"):
            await lm.open_session("world")  # the abandoned open still runs on the host
        pool.go.set()  # and then ends
        await until(lambda: lm.live["world"].inflight == 0)
        opened = [e[2] for e in pool.log if e[:2] == ("session", "open")]
        assert len(opened) == 1 and ("session", "close", opened[0]) in pool.log  # closed once opened
        assert lm.sessions == {} and world.busy_until < float("inf")
        lm.evict("world", "host")  # not deferred: nothing holds it
        assert world.tier == Tier.HOST
        sid, _ = await lm.open_session("world")  # and the next session opens as usual
        await lm.close_session(sid)

    run(config, _releasing(body), wrap=lambda p: SlowSessions(p, gate=("open",)))


def test_a_session_close_cancelled_midway_still_frees_the_model(tmp_path: Path) -> None:
    # The stream's end closes its session; a second cancellation of that task (a server shutting
    # down with grace, a client gone) during the host's close left the model busy for good.
    config = setup(tmp_path)

    async def body(lm: LiveManager) -> None:
        pool, world = lm.pool, lm.engine.models["world"]
        sid, _ = await lm.open_session("world")
        closing = asyncio.create_task(lm.close_session(sid))
        await until(pool.entered.is_set)  # the host is closing it
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert lm.live["world"].inflight == 0 and world.busy_until < float("inf") and lm.sessions == {}
        assert lm.served == 1  # the session counts as served, and is logged as one
        pool.go.set()
        await until(lambda: ("session", "close", sid) in pool.log)  # the host still closes it

    run(config, _releasing(body), wrap=lambda p: SlowSessions(p, gate=("close",)))


def test_a_session_close_cancelled_while_it_waits_for_a_thread_still_reaches_the_host(tmp_path: Path) -> None:
    # Found by a chaos run with world sessions: a close cancelled while its call to the host still
    # waited for a free worker thread (all busy with requests) was dropped from the thread pool's
    # queue, so the host kept the session open (and its KV), and every later session on the model
    # was refused.
    from concurrent.futures import ThreadPoolExecutor

    config = setup(tmp_path)

    async def body(lm: LiveManager) -> None:
        pool = lm.pool
        sid, _ = await lm.open_session("world")
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(1))
        release = threading.Event()
        busy = loop.run_in_executor(None, release.wait)  # the one worker thread is taken
        closing = asyncio.create_task(lm.close_session(sid))
        await asyncio.sleep(0.1)  # the close waits in the thread pool's queue
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        release.set()
        await busy
        await until(lambda: ("session", "close", sid) in pool.log)  # it still reached the host
        again, _ = await lm.open_session("world")  # so the model takes a new session
        await lm.close_session(again)

    run(config, body, wrap=SlowSessions)


def test_a_second_world_session_on_the_same_model_is_refused_not_run_over_the_first(tmp_path: Path) -> None:
    # The model's rolling KV window holds one session: a second one, opened while the first ran,
    # reset the window under it. The manager now refuses it (RESOURCE_EXHAUSTED on the wire), also
    # while the first is still opening, and takes it once the first has ended.
    config = setup(tmp_path)

    async def body(lm: LiveManager) -> None:
        opening = asyncio.create_task(lm.open_session("world"))
        await until(lambda: lm.live["world"].inflight == 1)  # the first is opening on the host
        with pytest.raises(InsufficientCapacity, match=r"world model 'world' runs a session .*one at a time"):
            await lm.open_session("world")
        sid, _ = await opening
        refusal = r"runs a session; a world model runs one at a time"
        with pytest.raises(InsufficientCapacity, match=refusal) as e:
            await lm.open_session("world")
        assert sid not in str(e.value)  # the id is all a resume needs: never told to another client
        await lm.step_session(sid, (0.0, 0.0, 0.0, 0.0, 0.0))
        assert (await lm.step_session(sid, (0.0, 0.0, 0.0, 0.0, 10.0)))["step"] == 1  # undisturbed
        await lm.close_session(sid)
        again, _ = await lm.open_session("world")
        await lm.close_session(again)
        # the two opens refused, counted as refusals (review 31: they were counted nowhere), not
        # through a queue limit (a busy world model is not a full queue)
        assert lm.live["world"].inflight == 0 and lm.rejected == 2

    run(config, body, wrap=lambda p: SlowSessions(p, open=0.4))


class DiesUnderTheFirstRequest(SlowToStart):
    """Its device host dies under the first inference: the model is gone from it, and the result
    says so (as a Ray actor's death does); later inferences run as usual."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        super().__init__(inner, delay_s)
        self.died = False

    def infer(self, device: str, model: str, inputs: Any, timeout_s: float) -> Any:
        if self.died:
            return super().infer(device, model, inputs, timeout_s)
        time.sleep(self.delay_s)
        self.died = True
        self.inner.hosts[device].apply(P.Drop(model), "died")
        self._note("died", model)
        return P.InferResult(model, False, error_code=P.WORKER_DIED, error="the device host died")


def test_an_admin_evict_that_waits_is_not_undone_by_the_requests_retry(tmp_path: Path) -> None:
    # The evict that waits for the requests in flight was carried out after the first attempt of a
    # request that the device host then retried (it had died under it): the retry loaded the model
    # again, and the admin's evict was lost. It waits for the request's end, retries included.
    config = one_of_two(tmp_path, chat_pinned=False, device_models=2.5)

    async def body(lm: LiveManager) -> None:
        pool = lm.pool
        served = await (await evicted_in_flight(lm))
        assert served.result.ok and served.cold  # lost under the request, reloaded, served
        assert lm.engine.models["other"].tier == Tier.HOST  # and then the evict was carried out
        assert lm.live["other"].evict_to is None
        moves = [e[:2] for e in pool.log if e[-1] == "other" and e[0] in ("submit", "infer", "died")]
        # the lost model taken off the books: one Drop to make sure (no demote of what is not there)
        lost = [("submit", "Drop")]
        assert moves == [("submit", "Load"), ("died", "other"), *lost, ("submit", "Load"), ("infer", "other"),
                         ("submit", "Demote")]  # fmt: skip
        # losing it was no eviction (nothing decided it), and its reload no thrash: the admin's evict is
        # the one eviction
        assert (lm.engine.counters.evictions, lm.engine.counters.thrash) == (1, 0)

    run(config, body, wrap=lambda p: DiesUnderTheFirstRequest(p, delay_s=0.5))


def test_a_model_pinned_by_a_reload_is_loaded_into_free_room(tmp_path: Path) -> None:
    config = one_of_two(tmp_path, chat_pinned=False, device_models=2.5)  # room for both

    async def body(lm: LiveManager) -> None:
        pool = lm.pool
        assert lm.engine.models["other"].tier != Tier.GPU
        models = [m.model_copy(update={"pin": True}) if m.name == "other" else m for m in config.models]
        assert lm.reload(config.model_copy(update={"models": models})) == ["models.other.pin"]
        assert lm.engine.models["other"].tier == Tier.GPU  # as the config's pins are at start
        await until(lambda: "other" in pool.status("cpu0").models)

    run(config, body)


def test_a_failed_demote_drops_the_model_so_the_device_holds_what_the_books_say(tmp_path: Path) -> None:
    """The host could not copy chat out (host RAM exhausted, say) and kept it on the device; the books
    had already moved it to host RAM and given its room to the next load, so the device held two models
    where one and a half fit (found in review, 2026-12-01)."""
    config = one_of_two(tmp_path, chat_pinned=False, device_models=1.5)

    async def main() -> None:
        pool = create_pool(config, in_process=True)
        host = pool.hosts["cpu0"]

        def failing_demote(r: Any, op_id: str, op: str) -> Any:
            raise RuntimeError("cannot allocate memory")

        host._demote = failing_demote
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            await lm.preload("chat")
            lm.evict("chat", "host")
            await until(lambda: pool.pending() == 0 and not lm._ops)
            assert lm.engine.models["chat"].tier == Tier.DISK and "chat" not in pool.status("cpu0").models
            await lm.infer("other", X, timeout_s=5)
            st = pool.status("cpu0")
            held = sum(s.device_bytes for s in st.models.values() if s.tier == "gpu")
            assert held <= lm.engine.state.devices["cpu0"].usable and set(st.models) == {"other"}
        finally:
            await lm.stop()
            pool.close()

    asyncio.run(main())


def test_a_session_waiting_for_its_models_unconfirmed_load_does_not_expire_it(tmp_path: Path) -> None:
    """open_session admitted without counting the model as waited for, so while its load was
    unconfirmed (a busy host) the engine expired the world model under the open, again and again."""
    config = setup(tmp_path, sessions=True, world_keep_alive="1s")

    async def main() -> None:
        pool = Recording(create_pool(config, in_process=True), hold={"world:load": 3.0})
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            sid, _ = await lm.open_session("world", timeout_s=15)
            await lm.close_session(sid)
            loads = [e for e in pool.log if e[:2] == ("submit", "Load") and e[2] == "world"]
            assert len(loads) == 1 and lm.engine.counters.expiries == 0 and lm.engine.counters.thrash == 0
        finally:
            await lm.stop()
            pool.close()

    asyncio.run(main())


def test_a_grown_lease_waits_for_a_slow_demote_past_the_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """After LEASE_WAIT_S a grown lease was applied anyway, into room the device still held while a
    slow demote (a long copy out, a big load ahead of it) was under way."""
    import manager.live_sessions as ls

    monkeypatch.setattr(ls, "LEASE_WAIT_S", 0.3)
    config = setup(tmp_path, sessions=True)

    async def main() -> None:
        pool = Recording(create_pool(config, in_process=True))
        host = pool.inner.hosts["cpu0"]
        real_demote = host._demote

        def slow_demote(r: Any, op_id: str, op: str) -> Any:
            if r.spec.name == "mlp":
                time.sleep(1.5)
            return real_demote(r, op_id, op)

        host._demote = slow_demote
        lm = LiveManager(config, pool)
        await lm.start()
        world = lm.engine.models["world"]
        try:
            sid, _ = await lm.open_session("world")
            await lm.step_session(sid, (0.0,) * 5)
            await until(lambda: world.lease > 500 * 2**20)
            await lm.infer("mlp", X, timeout_s=10)  # shrinks the lease; mlp expires a second later
            await until(lambda: lm.engine.models["mlp"].tier != Tier.GPU and world.lease > 500 * 2**20)
            await until(lambda: any(e[0] == "resize-done" for e in pool.log[-3:]) and not lm._lease_chain)
            demoted = pool.log.index(("result", "demote", "mlp"))
            grows = [i for i, e in enumerate(pool.log) if e[0] == "resize-start" and int(e[1]) > 500 * 2**20]
            assert grows[-1] > demoted  # the grow reached the host only once mlp had left
            await lm.close_session(sid)
        finally:
            await lm.stop()
            pool.close()

    with caplog.at_level("WARNING", logger="manager.live"):
        asyncio.run(main())
    assert "a grown lease still waits for the room it needs" in caplog.text


def test_a_client_gone_during_a_session_reopen_leaves_no_session_open_on_the_host(tmp_path: Path) -> None:
    """The host lost the session under a step, and the manager reopened it; the client hung up during
    the reopen. The close reached the host before the reopen ended, so the reopened session stayed open
    there, and every later session on the model was refused (found in review, 2026-12-01)."""
    config = setup(tmp_path, sessions=True)

    class LosesSessionOnce(Recording):
        """The host restarts empty of sessions under the second step; a reopen takes 0.8 s."""

        steps = 0

        def session(self, device: str, method: str, *args: Any, timeout_s: float = 120.0) -> P.SessionReply:
            if method == "step":
                self.steps += 1
                if self.steps == 2:
                    self.inner.hosts[device].world.close(args[0])
                    return P.SessionReply(False, error_code=P.NO_SESSION, error="host restarted")
            if method == "open" and args[4]:  # a resume
                time.sleep(0.8)
            return super().session(device, method, *args, timeout_s=timeout_s)

    async def main() -> None:
        pool = LosesSessionOnce(create_pool(config, in_process=True))
        lm = LiveManager(config, pool)
        await lm.start()
        host_sessions = pool.inner.hosts["cpu0"].world.open_sessions
        try:
            sid = None

            async def stream() -> None:  # as manager/api/world.py's Run does
                nonlocal sid
                try:
                    sid, _ = await lm.open_session("world")
                    for i in range(3):
                        await lm.step_session(sid, (float(i), 0, 0, 0, 0))
                finally:
                    if sid is not None and sid in lm.sessions:
                        await lm.close_session(sid)

            task = asyncio.create_task(stream())
            await until(lambda: pool.steps >= 2)
            await asyncio.sleep(0.3)  # the reopen is under way on the host
            task.cancel()  # the client hangs up
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await asyncio.sleep(1.0)  # the reopen ends (0.8 s), and what follows it
            await until(lambda: not lm._background)
            assert lm.sessions == {} and host_sessions == {}
            again, _ = await lm.open_session("world", timeout_s=5)  # the world model is free again
            await lm.close_session(again)
        finally:
            await lm.stop()
            pool.close()

    asyncio.run(main())


def test_lease_changes_decided_while_a_session_opens_reach_it(tmp_path: Path) -> None:
    """A lease change went only to the sessions already open: one decided while a session was being
    opened on its host was lost. A grow left the session at its minimum; a shrink (a client that
    reconnects at once, the lease still grown) left the host's session at the big lease while the
    books gave that room to another model (found in review, 2026-12-01)."""
    config = setup(tmp_path, sessions=True)

    class SlowOpen(Recording):
        """Opens take `slow` seconds on the host (a resume reading its log, a busy disk)."""

        slow = 0.0

        def session(self, device: str, method: str, *args: Any, timeout_s: float = 120.0) -> P.SessionReply:
            if method == "open":
                time.sleep(self.slow)
            return super().session(device, method, *args, timeout_s=timeout_s)

    async def main() -> None:
        pool = SlowOpen(create_pool(config, in_process=True))
        lm = LiveManager(config, pool)
        await lm.start()
        world, dev = lm.engine.models["world"], lm.engine.state.devices["cpu0"]
        on_host = pool.inner.hosts["cpu0"].world.open_sessions
        try:
            pool.slow = 1.5  # the engine grows the lease while the session opens
            a, _ = await lm.open_session("world")
            await lm.step_session(a, (0.0,) * 5)
            await until(lambda: not lm._lease_chain)
            assert world.lease > 500 * 2**20 and on_host[a].lease == world.lease
            await lm.close_session(a)

            pool.slow = 0.8  # a client reconnects at once, the lease still grown; mlp comes meanwhile
            opening = asyncio.create_task(lm.open_session("world"))
            await asyncio.sleep(0.2)
            await lm.infer("mlp", X, timeout_s=10)  # the books take lease room back for it
            c, _ = await opening
            assert on_host[c].lease == world.lease  # shrunk before the open's reply
            held = world.weights + on_host[c].lease + lm.engine.models["mlp"].weights
            assert held <= dev.usable
            await lm.close_session(c)
        finally:
            await lm.stop()
            pool.close()

    asyncio.run(main())


def test_a_preload_to_host_ram_without_room_says_so(tmp_path: Path) -> None:
    """It returned as if done, and nothing was loaded."""
    config = one_of_two(tmp_path, chat_pinned=False)
    text = (
        (tmp_path / "c.yaml")
        .read_text()
        .replace("host: {memory: 8GiB, reserve: 1GiB}", "host: {memory: 2MiB, reserve: 1MiB}")
    )
    (tmp_path / "c.yaml").write_text(text)
    config = load_config(tmp_path / "c.yaml")

    async def body(lm: LiveManager) -> None:
        with pytest.raises(InsufficientCapacity, match=r"model 'chat': no room in host RAM"):
            await lm.preload("chat", "host")
        assert lm.engine.models["chat"].tier == Tier.DISK

    run(config, body)


def test_a_request_whose_client_hung_up_keeps_its_model_busy_until_the_call_ends(tmp_path: Path) -> None:
    """The caller's cancellation ended the request's bookkeeping at once while the device host still
    ran the call: the model counted idle, and an admin's evict (or the policy) took it off the device
    under a running inference (found in review, 2026-12-01)."""
    config = one_of_two(tmp_path, chat_pinned=False)

    go = threading.Event()

    class SlowInfer(Recording):
        """Inferences run on the host until the test lets them end (a big model)."""

        def infer(self, device: str, model: str, inputs: Any, timeout_s: float = 60.0) -> P.InferResult:
            self._note("infer-start", model)
            assert go.wait(60), "the test never let the inference end"
            result: P.InferResult = self.inner.infer(device, model, inputs, timeout_s)
            self._note("infer-end", model)
            return result

    async def main() -> None:
        pool = SlowInfer(create_pool(config, in_process=True))
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            await lm.preload("chat")
            request = asyncio.create_task(lm.infer("chat", X, timeout_s=10))
            await until(lambda: ("infer-start", "chat") in pool.log)
            request.cancel()  # the client hangs up mid-inference
            with contextlib.suppress(asyncio.CancelledError):
                await request
            assert lm.live["chat"].inflight == 1  # still running on the host
            lm.evict("chat", "disk")  # deferred: the call is still running
            assert lm.engine.models["chat"].tier == Tier.GPU
            go.set()  # the call ends on the host
            await until(lambda: ("infer-end", "chat") in pool.log)
            await until(lambda: lm.engine.models["chat"].tier == Tier.DISK)  # the evict, once it ended
            ended = pool.log.index(("infer-end", "chat"))
            assert all(e != ("submit", "Drop", "chat") for e in pool.log[:ended])
            assert lm.live["chat"].inflight == 0
        finally:
            go.set()  # (whatever happened: the stop does not wait for a held call)
            await lm.stop()
            pool.close()

    asyncio.run(main())
