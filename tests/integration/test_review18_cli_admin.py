"""Found in the 18th review's user walkthrough of the `residency` CLI; each test failed before its fix.

The CLI had no admin commands: to pin, preload, evict, see the statistics, reload the config or watch
the events, a user had to read the proto and call grpcurl. Here each new command runs against the real
service (its gRPC server in this process on a free port, in-process device hosts, the CPU home of
configs/local-cpu.yaml: silero-vad, MiniLM and WorldPager's world stand-in), and `ps` shows the world
model's KV lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from manager.api.server import build_server
from manager.cli import main
from manager.config import load_config
from manager.live import LiveManager
from manager.policy.types import Tier
from manager.workers_bridge import create_pool

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "local-cpu.yaml"
TOKEN = "review18-cli-token"


def _config_file(tmp_path: Path, token_env: str | None = None, tls: tuple[Path, Path] | None = None) -> Path:
    """configs/local-cpu.yaml on a free port (and with `token_env` as its admin token's variable,
    serving TLS with the certificate and key `tls`)."""
    extra = f", auth_token_env: {token_env}" if token_env else ""
    extra += f", tls_cert: {tls[0]}, tls_key: {tls[1]}" if tls else ""
    server = f'server: {{listen: "127.0.0.1:0"{extra}}}\n'
    path = tmp_path / "home.yaml"
    path.write_text(server + f'store: {{url: "sqlite:///{tmp_path}/state.db"}}\n' + CONFIG.read_text())
    return path


@contextlib.asynccontextmanager
async def serving(path: Path) -> AsyncIterator[tuple[str, LiveManager]]:
    """The service started from the config file `path` (so ReloadConfig reads it): its target and
    its manager."""
    cfg = load_config(path)
    pool = create_pool(cfg, in_process=True)
    manager = LiveManager(cfg, pool)
    server, port, _ = await build_server(cfg, manager, str(path))
    await server.start()
    await manager.start()
    try:
        yield f"127.0.0.1:{port}", manager
    finally:
        await server.stop(None)
        await manager.stop()
        pool.close()


def with_service(tmp_path: Path, body: Callable[[str, LiveManager, Path], Awaitable[None]]) -> None:
    path = _config_file(tmp_path)

    async def run() -> None:
        async with serving(path) as (target, manager):
            await body(target, manager, path)

    asyncio.run(run())


async def cli(*argv: str) -> int:
    """`residency ARGV` (its own thread: the service runs on this event loop)."""
    return await asyncio.to_thread(main, list(argv))


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.02)


def test_pin_and_unpin(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async def body(target: str, manager: LiveManager, _: Path) -> None:
        assert await cli("pin", "embed", "--target", target) == 0
        assert manager.engine.models["embed"].pinned
        assert one_line(capsys.readouterr().out).startswith("embed: pinned (")
        assert await cli("unpin", "embed", "--target", target, "--json") == 0
        assert not manager.engine.models["embed"].pinned
        status = json.loads(capsys.readouterr().out)
        assert status["name"] == "embed" and status["pinned"] is False

    with_service(tmp_path, body)


def test_preload_and_evict_between_the_tiers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async def body(target: str, manager: LiveManager, _: Path) -> None:
        embed = manager.engine.models["embed"]
        await until(lambda: not manager.live["embed"].loads_pending, "the prewarm settled")
        assert await cli("evict", "embed", "--to", "disk", "--target", target) == 0
        capsys.readouterr()
        assert await cli("preload", "embed", "--tier", "host", "--target", target) == 0
        assert embed.tier == Tier.HOST
        assert one_line(capsys.readouterr().out) == "embed: preloaded to host (now host on cpu0)"
        assert await cli("preload", "embed", "--target", target) == 0  # gpu by default
        assert embed.tier == Tier.GPU
        assert one_line(capsys.readouterr().out).startswith("embed: preloaded to gpu (now gpu on cpu0")
        assert await cli("evict", "embed", "--to", "host", "--target", target) == 0
        assert embed.tier == Tier.HOST
        assert one_line(capsys.readouterr().out) == "embed: evicted to host (now host on cpu0)"
        assert await cli("evict", "embed", "--target", target) == 0  # disk by default
        assert embed.tier == Tier.DISK
        assert one_line(capsys.readouterr().out) == "embed: evicted to disk (now disk on cpu0)"

    with_service(tmp_path, body)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["evict", "voice"], "model 'voice' is pinned; unpin it first"),  # pinned in the config
        (["pin", "nosuch"], "NOT_FOUND: unknown model 'nosuch'"),
        (["preload", "nosuch", "--tier", "host"], "NOT_FOUND: unknown model 'nosuch'"),
    ],
)
def test_a_refusal_by_the_service_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    async def body(target: str, manager: LiveManager, _: Path) -> None:
        assert await cli(*argv, "--target", target) == 1
        cap = capsys.readouterr()
        assert cap.out == ""
        line = one_line(cap.err)
        assert line.startswith(f"residency: {target}: ") and says in line, line

    with_service(tmp_path, body)


def test_stats_as_a_line_and_as_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async def body(target: str, manager: LiveManager, _: Path) -> None:
        await until(lambda: manager.engine.models["voice"].tier == Tier.GPU, "the pinned voice is loaded")
        assert await cli("stats", "--target", target) == 0
        line = one_line(capsys.readouterr().out)
        assert (
            line.startswith("requests 0, cold starts 0, load wait 0.000 s, evictions ")
            and "resident: cpu0 " in line
        )
        assert await cli("stats", "--target", target, "--json") == 0
        stats = json.loads(capsys.readouterr().out)
        assert stats["requests"] == 0 and stats["resident_bytes"]["cpu0"] > 0

    with_service(tmp_path, body)


def test_reload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async def body(target: str, manager: LiveManager, path: Path) -> None:
        assert await cli("reload", "--target", target) == 0
        assert one_line(capsys.readouterr().out) == f"config reloaded from {path}: no changes"
        path.write_text(
            path.read_text().replace(
                "keep_alive: auto\n    source: {preset", "keep_alive: 10m\n    source: {preset"
            )
        )
        assert await cli("reload", "--target", target) == 0
        line = one_line(capsys.readouterr().out)
        assert line.startswith(f"config reloaded from {path}: changed: ") and "world" in line, line
        path.write_text(path.read_text().replace("keep_alive: 10m", "keep_alive: soon"))
        assert await cli("reload", "--target", target, "--json") == 1  # refused: nothing printed on stdout
        cap = capsys.readouterr()
        assert cap.out == "" and "INVALID_ARGUMENT: config not reloaded" in one_line(cap.err)

    with_service(tmp_path, body)


def test_ps_shows_the_world_models_lease(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The world model showed 49.9 MiB (its weights) and nothing of the KV lease it held."""

    async def body(target: str, manager: LiveManager, _: Path) -> None:
        assert await cli("preload", "world", "--target", target) == 0
        world = manager.engine.models["world"]
        assert world.tier == Tier.GPU and world.lease >= 64 * 2**20
        capsys.readouterr()
        assert await cli("ps", "--target", target, "--json") == 0
        listed = {m["name"]: m for m in json.loads(capsys.readouterr().out)["models"]}
        assert await cli("ps", "--target", target) == 0
        out = capsys.readouterr().out
        lines = [ln for ln in out.splitlines() if "│" in ln or "┃" in ln]
        cells = [[c.strip() for c in ln.replace("┃", "│").split("│")[1:-1]] for ln in lines]
        header, rows = cells[0], {r[0]: r for r in cells[1:]}
        lease = header.index("lease MiB")
        assert rows["world"][lease] == f"{listed['world']['lease_bytes'] / 2**20:.1f}"
        assert rows["world"][header.index("MiB")] == "49.9"
        assert rows["voice"][lease] == "" and rows["embed"][lease] == ""

    with_service(tmp_path, body)


def test_a_service_that_wants_a_token_gets_it_from_the_configs_variable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As `ps`: --config names the address and the token's variable; without the token, exit 2 saying
    why none was sent."""
    monkeypatch.setenv("REVIEW18_ADMIN_TOKEN", TOKEN)
    path = _config_file(tmp_path, token_env="REVIEW18_ADMIN_TOKEN")

    async def run() -> None:
        async with serving(path) as (target, manager):
            port = target.rpartition(":")[2]
            client = tmp_path / "client.yaml"  # the same config, naming the port the server got
            client.write_text(path.read_text().replace("127.0.0.1:0", f"127.0.0.1:{port}"))
            assert await cli("pin", "embed", "--config", str(client)) == 0
            assert manager.engine.models["embed"].pinned
            capsys.readouterr()
            monkeypatch.delenv("REVIEW18_ADMIN_TOKEN")
            assert await cli("unpin", "embed", "--config", str(client)) == 2
            line = one_line(capsys.readouterr().err)
            assert "UNAUTHENTICATED" in line and "$REVIEW18_ADMIN_TOKEN is not set here" in line, line
            assert manager.engine.models["embed"].pinned

    asyncio.run(run())


@pytest.mark.parametrize("as_json", [False, True], ids=["lines", "json"])
def test_events_stream_one_line_each_until_ctrl_c(tmp_path: Path, as_json: bool) -> None:
    async def body(target: str, manager: LiveManager, _: Path) -> None:
        await until(lambda: not manager.live["embed"].loads_pending, "the prewarm settled")
        json_flag = ["--json"] if as_json else []
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "manager.cli", "events", "--target", target, *json_flag,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=str(tmp_path),
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        try:
            await until(lambda: len(manager._subscribers) == 1, "the CLI follows the events")
            manager.evict("embed", "disk")
            assert proc.stdout is not None
            lines = [(await asyncio.wait_for(proc.stdout.readline(), 30)).decode() for _ in range(1)]
            proc.send_signal(signal.SIGINT)  # Ctrl-C
            rc = await asyncio.wait_for(proc.wait(), 30)
            rest = (await proc.stdout.read()).decode()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.stderr is not None
        err = (await proc.stderr.read()).decode()
        assert rc == 0 and "Traceback" not in err, err
        got = [ln for ln in (lines[0] + rest).splitlines() if ln]
        assert got, "no event printed"
        if as_json:
            first: dict[str, Any] = json.loads(got[0])
            assert set(first) == {"t", "kind", "model", "detail", "device"}
            assert first["model"] == "embed"
        else:
            assert " embed " in got[0] + " " and "cpu0" in got[0], got

    with_service(tmp_path, body)


def test_tls_as_ps_speaks_it(
    tmp_path: Path, tls_pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """--tls-cert trusts a TLS server's certificate; plaintext to it cannot connect: exit 2, saying
    why (as `ps`)."""
    cert, _ = tls_pair
    path = _config_file(tmp_path, tls=tls_pair)

    async def run() -> None:
        async with serving(path) as (target, manager):
            assert await cli("pin", "embed", "--target", target, "--tls-cert", str(cert)) == 0
            assert manager.engine.models["embed"].pinned
            capsys.readouterr()
            assert await cli("unpin", "embed", "--target", target) == 2
            line = one_line(capsys.readouterr().err)
            assert "UNAVAILABLE" in line and "--tls-cert" in line, line
            assert manager.engine.models["embed"].pinned

    asyncio.run(run())


# Review 19's user walkthrough: `residency reload --config OTHER.yaml` answered "config reloaded: no
# changes", exit 0, though the service never read OTHER.yaml: it reads its own file again (the one
# `serve` was given), and --config only says how to reach it. Now the answer names the file the
# service read (`ReloadConfigResponse.path`), and a --config naming another file is exit 1, saying so.


def test_reload_names_the_file_the_service_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _config_file(tmp_path)

    async def run() -> None:
        async with serving(path) as (target, _):
            assert await cli("reload", "--config", str(path), "--target", target) == 0
            assert one_line(capsys.readouterr().out) == f"config reloaded from {path}: no changes"
            assert await cli("reload", "--target", target, "--json") == 0
            assert json.loads(capsys.readouterr().out)["path"] == str(path)

    asyncio.run(run())


def test_another_file_named_by_config_is_exit_1_saying_it_was_not_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _config_file(tmp_path)
    other = tmp_path / "other.yaml"
    other.write_text(
        path.read_text().replace(
            "keep_alive: auto\n    source: {preset", "keep_alive: 45m\n    source: {preset"
        )
    )
    assert other.read_text() != path.read_text()

    async def run() -> None:
        async with serving(path) as (target, manager):
            before = manager.engine.models["world"].keep_alive_cfg
            assert await cli("reload", "--config", str(other), "--target", target) == 1
            cap = capsys.readouterr()
            assert one_line(cap.out) == f"config reloaded from {path}: no changes"
            err = one_line(cap.err)
            assert err.startswith(f"residency: {other} was not read: the service serves {path}"), err
            assert f"residency serve --config {other}" in err
            assert manager.engine.models["world"].keep_alive_cfg == before  # other.yaml's 45m: not applied

    asyncio.run(run())


def test_a_copy_of_the_served_file_elsewhere_is_the_same_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Read-through of review 19: the paths were compared alone, so a service in a container or on
    another host (its own copy of the file, at another path) made `reload --config` exit 1, "was not
    read", though the bytes it read are the user's. The service now sends their SHA-256 too."""
    path = _config_file(tmp_path)
    copy = tmp_path / "elsewhere" / "config.yaml"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())

    async def run() -> None:
        async with serving(path) as (target, _):
            assert await cli("reload", "--config", str(copy), "--target", target) == 0
            cap = capsys.readouterr()
            assert one_line(cap.out) == f"config reloaded from {path}: no changes" and cap.err == ""

    asyncio.run(run())
