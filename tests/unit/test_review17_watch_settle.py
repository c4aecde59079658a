"""Review 17: the config watcher reloaded a file it found changed at once; a file written in place
(truncated, then written) and polled half-way was reloaded half-written (a part applied, or a
`config_rejected` event for a file nobody got wrong). It now waits until the file has not changed
for `SETTLE_S`. The file's identities and the reload are fakes here (unit test only), so the poll
lands half-way every time; `tests/unit/test_reload.py` runs the watcher on real files."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import manager.api.admin as admin
import manager.api.server as server_mod


def test_a_file_caught_half_written_is_reloaded_once_it_settles(monkeypatch: pytest.MonkeyPatch) -> None:
    # what each look at the file finds: as served; being written (twice, changing); then done
    looks = iter([(1, 1, 100, 1), (1, 1, 0, 2), (1, 1, 40, 3), (1, 1, 120, 4), (1, 1, 120, 4)])
    last = [(1, 1, 120, 4)]

    def identity(path: str) -> tuple[int, int, int, int]:
        last[0] = next(looks, last[0])
        return last[0]

    reloads: list[tuple[int, int, int, int]] = []

    async def reload(manager: Any, path: str) -> list[str]:
        reloads.append(last[0])
        return ["policy.thrash_window"]

    monkeypatch.setattr(server_mod, "file_identity", identity)
    monkeypatch.setattr(admin, "reload_from_file_on_loop", reload)
    monkeypatch.setattr(server_mod, "SETTLE_S", 0.0)

    async def main() -> None:
        task = asyncio.ensure_future(server_mod.watch_config(object(), "c.yaml", every_s=0.0))  # type: ignore[arg-type]
        # (each look at the file runs on a thread since review 31: real time, not loop turns alone)
        for _ in range(500):
            await asyncio.sleep(0.01)
            if reloads:
                break
        await asyncio.sleep(0.1)  # (a second reload would come here: the file settled, none does)
        task.cancel()

    asyncio.run(main())
    assert reloads == [(1, 1, 120, 4)]  # once, the file as finished; never half-written
