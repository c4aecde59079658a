"""Review 21, a walkthrough of hot reload and the admin commands around it:

- A config path that was a FIFO (a symlink re-pointed at one) held the reload's read until something
  wrote into it: the watcher stopped for good and every `residency reload` hung. Now a file that is
  not a regular file is refused at once, naming what it is.
- An unknown key in `server:` read by an admin command (`stats --config`) was hinted with the
  top-level sections' names; now as `config check` says it (`did you mean 'listen'?`).
- A refused `residency reload` was neither logged nor said in an event (the watcher's refusals are).
- A reload that changed a model's `pin` while an admin's pin or unpin held it said the pin changed.
- The refusal of pins that do not fit showed an elastic model's weights and lease together beside
  the config's `memory` (which is the weights alone); the updated expectation is in
  test_review13_live.py."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from live_helpers import CONFIG, in_time, run

from manager.api.admin import AdminServicer, reload_from_file
from manager.cli import main
from manager.config import ConfigError, load_config
from manager.errors import InvalidRequest
from manager.live import LiveManager
from residency_proto.v1 import residency_pb2 as pb


def test_a_fifo_at_the_config_path_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    got = in_time(lambda: load_config(fifo))
    assert isinstance(got, ConfigError) and "not a regular file (a FIFO)" in str(got), got
    got = in_time(lambda: load_config(tmp_path))
    assert isinstance(got, ConfigError) and "not a regular file (a folder)" in str(got), got
    assert load_config(CONFIG).models  # a regular file reads as before


def test_a_reload_of_a_path_turned_into_a_fifo_is_refused_and_the_next_one_works(tmp_path: Path) -> None:
    real = tmp_path / "a.yaml"
    real.write_text(CONFIG.read_text())
    link = tmp_path / "live.yaml"
    link.symlink_to(real.name)
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)

    async def body(lm: LiveManager) -> None:
        link.unlink()
        link.symlink_to(fifo.name)
        got = await asyncio.wait_for(asyncio.to_thread(in_time, lambda: reload_from_file(lm, str(link))), 20)
        assert isinstance(got, InvalidRequest) and "not a regular file (a FIFO)" in str(got), got
        link.unlink()
        link.symlink_to(real.name)
        real.write_text(CONFIG.read_text().replace("keep_alive: auto", "keep_alive: 3m", 1))
        assert reload_from_file(lm, str(link)) == ["models.world.keep_alive"]

    run(load_config(link), body)


def test_an_unknown_server_key_read_by_an_admin_command_is_hinted_as_config_check_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = yaml.safe_load(CONFIG.read_text())
    data["server"] = {"listen": "127.0.0.1:1", "listn": "x"}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main(["stats", "--config", str(cfg)]) == 2
    said = capsys.readouterr().err
    assert "server.listn: unknown field 'listn' (did you mean 'listen'?)" in said, said
    assert main(["config", "check", str(cfg)]) == 2
    assert "(did you mean 'listen'?)" in capsys.readouterr().err


class _Aborted(Exception):
    pass


class _Context:
    """A gRPC servicer context (unit test only): `abort` raises, as grpc.aio's does."""

    def __init__(self) -> None:
        self.code: Any = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise _Aborted(details)


def test_a_refused_admin_reload_is_logged_and_said_in_an_event(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG.read_text())

    async def body(lm: LiveManager) -> None:
        events = lm.subscribe()
        cfg.write_text(CONFIG.read_text() + "junk: [\n")
        ctx = _Context()
        with caplog.at_level(logging.WARNING, logger="manager.api.admin"), pytest.raises(_Aborted) as e:
            await AdminServicer(lm, str(cfg)).ReloadConfig(pb.ReloadConfigRequest(), ctx)
        assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and "YAML syntax error" in str(e.value)
        assert "config not reloaded" in caplog.text and "YAML syntax error" in caplog.text
        said = []
        while not events.empty():
            said.append(events.get_nowait())
        rejected = [ev for ev in said if ev["kind"] == "config_rejected"]
        assert len(rejected) == 1 and "YAML syntax error" in rejected[0]["detail"], said

    run(load_config(cfg), body)


def test_a_pin_an_admin_holds_is_said_as_held_by_a_reload(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG.read_text())

    async def body(lm: LiveManager) -> None:
        lm.set_pin("voice", False)
        cfg.write_text(CONFIG.read_text().replace("pin: true", "pin: false", 1))
        assert reload_from_file(lm, str(cfg)) == ["models.voice.pin (an admin's unpin holds)"]
        assert not lm.engine.models["voice"].pinned

    run(load_config(cfg), body)
