"""A request's own keep-alive (Ollama's per-request `keep_alive`): read from an OIP parameter and a
trace line, honoured by the engine (`residency`, `lru-keepalive`), replayed, logged to the store and
exported again; a version-1 SQLite store gains the column at the service's open."""

from __future__ import annotations

import io
import math
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from live_helpers import POSES, TEXT, local_config, run, served_world_config, until
from test_sim import T0, m, server

from manager.api import oip
from manager.api.admin import model_status
from manager.errors import InvalidRequest
from manager.live import LiveManager
from manager.policy.types import Request, Tier
from manager.replay.sim import replay
from manager.replay.trace import parse_line, request_to_json
from manager.store import open_store
from manager.store.export import export_trace
from manager.store.sqlite import SCHEMA_VERSION
from manager.units import parse_keep_alive
from residency_proto.inference import grpc_service_pb2 as pb


def req(t: float, model: str, keep_alive: float | None = None, busy: float = 1.0) -> Request:
    return Request(t=T0 + t, model=model, busy_s=busy, keep_alive=keep_alive)


class TestParsing:
    @pytest.mark.parametrize(
        ("given", "seconds"),
        [("10m", 600.0), ("0", 0.0), (0, 0.0), (90, 90.0), (2.5, 2.5), ("1h30m", 5400.0)],
    )
    def test_a_duration_or_seconds(self, given: Any, seconds: float) -> None:
        assert parse_keep_alive(given) == seconds

    @pytest.mark.parametrize(
        "given",
        ["forever", "Forever", -1, -0.5, "-1", " -1 ", "-1m", -(10**400), float("inf"), float("-inf")],
    )
    def test_forever_and_negatives_keep_it_forever_as_ollama_reads_them(self, given: Any) -> None:
        assert parse_keep_alive(given) == math.inf

    @pytest.mark.parametrize("given", ["-0", "-0s", -0.0])
    def test_minus_zero_is_zero_as_go_reads_it(self, given: Any) -> None:
        assert parse_keep_alive(given) == 0.0  # (found in review: "-0" was forever)

    def test_a_huge_negative_integer_on_a_trace_line_is_forever_not_a_traceback(self) -> None:
        # found in review: math.isinf of an int too large for a float raised OverflowError, which the
        # trace reader, the journal and the Redis store did not catch
        r = parse_line('{"t": 1, "model": "llm", "busy_s": 2, "keep_alive": -' + "9" * 400 + "}", 1)
        assert r.keep_alive == math.inf

    @pytest.mark.parametrize("given", ["soon", "--1", "-x", float("nan"), True, "1e400"])
    def test_anything_else_is_refused_saying_what_is_expected(self, given: Any) -> None:
        with pytest.raises(ValueError, match="expected a keep-alive"):
            parse_keep_alive(given)

    def test_a_trace_line_carries_it_and_writes_it_back(self) -> None:
        r = parse_line('{"t": 1, "model": "llm", "busy_s": 2, "keep_alive": "10m"}', 1)
        assert r.keep_alive == 600.0
        assert parse_line(request_to_json(r), 1) == r
        forever = Request(t=1.0, model="llm", busy_s=2.0, keep_alive=math.inf)
        assert '"keep_alive":"forever"' in request_to_json(forever)
        assert parse_line(request_to_json(forever), 1).keep_alive == math.inf
        assert parse_line('{"t": 1, "model": "llm", "busy_s": 2, "keep_alive": null}', 1).keep_alive is None
        assert "keep_alive" not in request_to_json(Request(t=1.0, model="llm", busy_s=2.0))

    @pytest.mark.parametrize("bad", ['"soon"', "true", "[1]", '{"s": 1}'])
    def test_a_bad_one_on_a_trace_line_is_named(self, bad: str) -> None:
        with pytest.raises(ValueError, match="'keep_alive'"):
            parse_line(f'{{"t": 1, "model": "llm", "busy_s": 2, "keep_alive": {bad}}}', 1)

    @staticmethod
    def _request(**param: Any) -> pb.ModelInferRequest:
        r = pb.ModelInferRequest(model_name="llm")
        for kind, v in param.items():
            setattr(r.parameters["keep_alive"], kind, v)
        return r

    @pytest.mark.parametrize(
        ("param", "seconds"),
        [
            ({"string_param": "10m"}, 600.0),
            ({"string_param": "forever"}, math.inf),
            ({"string_param": "-1"}, math.inf),
            ({"int64_param": 0}, 0.0),
            ({"int64_param": -1}, math.inf),
            ({"uint64_param": 3600}, 3600.0),
            ({"double_param": 2.5}, 2.5),
        ],
    )
    def test_the_oip_parameter(self, param: dict[str, Any], seconds: float) -> None:
        assert oip._keep_alive(self._request(**param)) == seconds

    def test_no_parameter_is_the_configs(self) -> None:
        assert oip._keep_alive(pb.ModelInferRequest(model_name="llm")) is None

    @pytest.mark.parametrize("param", [{"bool_param": True}, {"string_param": "soon"}])
    def test_a_bad_oip_parameter_is_refused_by_name(self, param: dict[str, Any]) -> None:
        with pytest.raises(InvalidRequest, match="parameter 'keep_alive'"):
            oip._keep_alive(self._request(**param))


class TestReplayed:
    """configs as test_sim's: 10 GiB GPU, explicit 10 min keep-alives, loads 4 s from disk, 2 s from
    the page cache, 1 s from host RAM; `chat` runs 1 s per request."""

    def cfg(self) -> Any:
        return server([m("chat", "interactive", "6GiB")])

    def test_a_longer_one_keeps_the_model_past_the_configs(self) -> None:
        # chat's config keeps it 10 min after its request: asked again 30 min later, it comes back
        # from host RAM (1 s); the first request asked for an hour, so the second finds it loaded.
        plain = replay(self.cfg(), [req(0, "chat"), req(1800, "chat")], "residency")
        kept = replay(self.cfg(), [req(0, "chat", 3600.0), req(1800, "chat")], "residency")
        assert plain.models["chat"].load_wait_s == pytest.approx(4.0 + 1.0)
        assert kept.models["chat"].load_wait_s == pytest.approx(4.0)

    def test_zero_unloads_it_once_idle(self) -> None:
        plain = replay(self.cfg(), [req(0, "chat"), req(60, "chat")], "residency")
        unloaded = replay(self.cfg(), [req(0, "chat", 0.0), req(60, "chat")], "residency")
        assert plain.models["chat"].load_wait_s == pytest.approx(4.0)
        assert unloaded.models["chat"].load_wait_s == pytest.approx(4.0 + 1.0)  # back from host RAM

    def test_it_holds_until_the_next_request_says_otherwise(self) -> None:
        # the hour asked at 0 ends with the request at 60, which gave none: the config's 10 min
        # again, so at 60 + 1200 s chat has left the GPU
        trace = [req(0, "chat", 3600.0), req(60, "chat"), req(1260, "chat")]
        assert replay(self.cfg(), trace, "residency").models["chat"].load_wait_s == pytest.approx(4.0 + 1.0)

    def test_ollamas_rule_honours_it_too(self) -> None:
        # lru-keepalive's own keep-alive is the policy default (5 min): 30 min later chat is
        # reloaded (from the page cache, 2 s) unless the request asked for an hour
        plain = replay(self.cfg(), [req(0, "chat"), req(1800, "chat")], "lru-keepalive")
        kept = replay(self.cfg(), [req(0, "chat", 3600.0), req(1800, "chat")], "lru-keepalive")
        assert plain.models["chat"].load_wait_s == pytest.approx(4.0 + 2.0)
        assert kept.models["chat"].load_wait_s == pytest.approx(4.0)

    def test_a_pin_still_wins(self) -> None:
        cfg = server([{**m("chat", "interactive", "6GiB"), "pin": True}])
        r = replay(cfg, [req(0, "chat", 0.0), req(60, "chat")], "residency")
        assert r.models["chat"].load_wait_s == 0.0  # loaded at the start, never unloaded


V1_SCHEMA = """
BEGIN;
CREATE TABLE requests (
    id INTEGER PRIMARY KEY, t REAL NOT NULL, model TEXT NOT NULL, busy_s REAL NOT NULL, "class" TEXT,
    kind TEXT NOT NULL DEFAULT 'infer', client TEXT, wait_s REAL, outcome TEXT, source TEXT
);
CREATE INDEX requests_t ON requests (t);
CREATE TABLE docs (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE intents (model TEXT PRIMARY KEY, tier TEXT NOT NULL);
INSERT INTO requests (t, model, busy_s, wait_s, outcome) VALUES (100.0, 'voice', 0.5, 0.0, 'ok');
PRAGMA user_version = 1;
COMMIT;
"""
"""A store as residency wrote it before schema version 2 (no requests.keep_alive), one request in it."""


class TestStored:
    def v1_store(self, tmp_path: Path) -> tuple[Path, str]:
        db = tmp_path / "state.db"
        with closing(sqlite3.connect(db)) as c:
            c.executescript(V1_SCHEMA)
        return db, f"sqlite:///{db}"

    @staticmethod
    def version(db: Path) -> int:
        with closing(sqlite3.connect(db)) as c:
            return int(c.execute("PRAGMA user_version").fetchone()[0])

    def test_a_version_1_store_is_read_as_it_is_by_a_read_only_open(self, tmp_path: Path) -> None:
        db, url = self.v1_store(tmp_path)
        store = open_store(url, create=False)
        try:
            assert [r["model"] for r in store.requests(0)] == ["voice"]
            assert "keep_alive" not in next(iter(store.requests(0)))
        finally:
            store.close()
        assert self.version(db) == 1  # nothing written

    def test_a_reader_of_version_1_reads_the_column_once_the_service_added_it(self, tmp_path: Path) -> None:
        """Found in review: a read-only open (an export) chose its columns once, so the rows the
        service wrote after migrating the file were read without their keep-alive."""
        _, url = self.v1_store(tmp_path)
        reader = open_store(url, create=False)
        service = open_store(url)
        try:
            service.append_requests([{"t": 200.0, "model": "llm", "busy_s": 1.0, "keep_alive": "forever"}])
            assert [r.get("keep_alive") for r in reader.requests(0)] == [None, "forever"]
        finally:
            service.close()
            reader.close()

    def test_the_services_open_adds_the_column_and_keeps_what_was_there(self, tmp_path: Path) -> None:
        db, url = self.v1_store(tmp_path)
        store = open_store(url)
        try:
            store.append_requests(
                [
                    {"t": 200.0, "model": "llm", "busy_s": 1.0, "keep_alive": 600.0},
                    {"t": 300.0, "model": "llm", "busy_s": 1.0, "keep_alive": "forever"},
                ]
            )
            got = list(store.requests(0))
            out = io.StringIO()
            assert export_trace(store, 1000.0, 1000.0, out) == 3
        finally:
            store.close()
        assert self.version(db) == SCHEMA_VERSION == 2
        assert [(r["model"], r.get("keep_alive")) for r in got] == [
            ("voice", None),
            ("llm", 600.0),
            ("llm", "forever"),
        ]
        lines = [parse_line(line, i) for i, line in enumerate(out.getvalue().splitlines(), 1)]
        assert [r.keep_alive for r in lines] == [None, 600.0, math.inf]


def test_the_live_manager_honours_logs_and_then_forgets_it(tmp_path: Path) -> None:
    """embed's config keep-alive is `auto` (learned; 5 min before it has learned anything): a
    request asking for 0 s has it unloaded once idle, and is logged with its keep-alive; the next
    request, asking for none, puts the config's back."""
    config = local_config(tmp_path, ("embed",))
    store = open_store(config.store.url)

    async def body(lm: LiveManager) -> None:
        embed = lm.engine.models["embed"]
        assert (await lm.infer("embed", TEXT, keep_alive=0.0)).result.ok
        assert embed.keep_alive_cfg == 0.0
        await until(lambda: embed.tier != Tier.GPU, "embed unloaded after a request asking for 0 s")
        assert (await lm.infer("embed", TEXT)).result.ok
        assert embed.keep_alive_cfg is None and embed.keep_alive_req is None  # the config's: auto
        assert (await lm.infer("embed", TEXT, keep_alive=math.inf)).result.ok
        assert lm.engine.policy.keep_alive(embed, lm.clock()) == math.inf
        status = model_status(lm, "embed")  # what `residency ps` shows
        assert (status.keep_alive_s, status.keep_alive_from) == (-1.0, "request")

    try:
        run(config, body, store=store)
        logged = [r.get("keep_alive") for r in store.requests(0)]
    finally:
        store.close()
    assert logged == [0.0, None, "forever"]


class TestShownByPs:
    """`residency ps` shows the keep-alive in force and whose word it is (`admin.keep_alive_in_force`):
    a pin, a request's own, the config's, or the policy's (learned, or its fixed default)."""

    def manager(self, policy: str, *models: dict[str, Any]) -> Any:
        from types import SimpleNamespace

        from manager.policy.engine import Engine
        from manager.policy.factory import create_policy

        cfg = server(list(models))
        cfg = cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"name": policy})})
        return SimpleNamespace(engine=Engine(cfg, create_policy(policy)))

    def test_whose_word_each_is(self) -> None:
        from manager.api.admin import keep_alive_in_force

        lm = self.manager(
            "residency",
            m("chat", "interactive", "2GiB"),  # test_sim's server: an explicit 10m
            {**m("auto", "interactive", "2GiB"), "keep_alive": "auto"},
            {**m("pinned", "interactive", "2GiB"), "pin": True},
        )
        chat = lm.engine.models["chat"]
        assert keep_alive_in_force(lm, "chat", T0) == (600.0, "config")
        assert keep_alive_in_force(lm, "auto", T0) == (300.0, "policy")  # nothing learned yet: 5 min
        assert keep_alive_in_force(lm, "pinned", T0) == (math.inf, "pin")
        lm.engine.request_keep_alive(chat, 3600.0)
        assert keep_alive_in_force(lm, "chat", T0) == (3600.0, "request")
        lm.engine.request_keep_alive(chat, None)
        assert keep_alive_in_force(lm, "chat", T0) == (600.0, "config")

    @pytest.mark.parametrize("configured", ["10m", "5m"])  # (5m: the policy's own, the same value)
    def test_ollamas_rule_keeps_its_own_not_the_configs(self, configured: str) -> None:
        from manager.api.admin import keep_alive_in_force

        lm = self.manager("lru-keepalive", {**m("chat", "interactive", "2GiB"), "keep_alive": configured})
        assert keep_alive_in_force(lm, "chat", T0) == (300.0, "policy")
        lm.engine.request_keep_alive(lm.engine.models["chat"], 0.0)
        assert keep_alive_in_force(lm, "chat", T0) == (0.0, "request")

    def test_the_histogram_policy_keeps_its_windows_whatever_is_asked(self) -> None:
        from manager.api.admin import keep_alive_in_force

        lm = self.manager("histogram", {**m("chat", "interactive", "2GiB"), "keep_alive": "5m"})
        assert keep_alive_in_force(lm, "chat", T0) == (300.0, "policy")
        lm.engine.request_keep_alive(lm.engine.models["chat"], 300.0)  # (its window's value, by chance)
        assert keep_alive_in_force(lm, "chat", T0) == (300.0, "policy")

    def test_the_table_shows_it(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        from manager.cli import main
        from residency_proto.v1 import residency_pb2 as rpb

        resp = rpb.ListResponse(
            models=[
                rpb.ModelStatus(name="chat", tier="gpu", keep_alive_s=3600, keep_alive_from="request",
                                keep_alive_left_s=3599.6),
                rpb.ModelStatus(name="voice", tier="gpu", pinned=True, keep_alive_s=-1, keep_alive_from="pin",
                                keep_alive_left_s=-1),
                rpb.ModelStatus(name="old", tier="disk"),  # an older server: no keep_alive_from
            ]
        )  # fmt: skip
        monkeypatch.setattr("manager.api.client.list_models", lambda *a, **k: resp)
        monkeypatch.setenv("COLUMNS", "200")
        assert main(["ps", "--target", "127.0.0.1:50051"]) == 0
        rows = {line.split()[1]: line for line in capsys.readouterr().out.splitlines() if "│" in line[:2]}
        assert "1h (request)" in rows["chat"] and "1h" in rows["chat"].split("(request)")[1]
        assert "forever (pin)" in rows["voice"]
        assert "(" not in rows["old"]


def test_a_world_session_takes_one_too(tmp_path: Path) -> None:
    """WorldStart.keep_alive: a session asking for 0 s has the world model leave the GPU once the
    session has ended; it is logged with the session; a malformed one is refused by name, before
    anything is admitted."""
    from manager.api.world import _keep_alive as world_keep_alive
    from residency_proto.v1 import residency_pb2 as rpb

    assert world_keep_alive(rpb.WorldStart(model="world")) is None
    assert world_keep_alive(rpb.WorldStart(model="world", keep_alive="-1")) == math.inf
    with pytest.raises(InvalidRequest, match=r"^start\.keep_alive: "):
        world_keep_alive(rpb.WorldStart(model="world", keep_alive="soon"))
    config = served_world_config(tmp_path)
    store = open_store(config.store.url)

    async def body(lm: LiveManager) -> None:
        world = lm.engine.models["world"]
        sid, _ = await lm.open_session("world", keep_alive=0.0)
        assert (await lm.step_session(sid, POSES[0]))["step"] == 0
        assert world.tier == Tier.GPU  # in use: kept whatever its keep-alive
        assert (model_status(lm, "world").keep_alive_s, model_status(lm, "world").keep_alive_from) == (
            0.0,
            "request",
        )
        await lm.close_session(sid)
        await until(lambda: world.tier != Tier.GPU, "world off the GPU once its session ended")

    try:
        run(config, body, store=store)
        logged = [(r.get("kind"), r.get("keep_alive")) for r in store.requests(0)]
    finally:
        store.close()
    assert logged == [("session", 0.0)]
