"""Review 17: `residency trace export --out` the service's own SQLite file (or its -wal, -shm, lock,
or the request journal) replaced the live database with a trace, and a running service went on
writing to the deleted file. It is refused now, naming the file, before anything is read or written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from manager.cli import main
from manager.store import open_store

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-cpu.yaml"


@pytest.mark.parametrize("tail", ["", "-wal", "-shm", ".lock"])
def test_exporting_over_the_stores_own_files_is_refused(
    tmp_path: Path, tail: str, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "state.db"
    open_store(f"sqlite:///{db}").close()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG.read_text() + f"store: {{url: 'sqlite:///{db}', journal: '{tmp_path}/j'}}\n")
    before = db.read_bytes()
    out = tmp_path / f"state.db{tail}"
    assert main(["trace", "export", "--config", str(cfg), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is the store's SQLite file" in err and "the export would replace it" in err
    assert db.read_bytes() == before


def test_exporting_over_the_journal_through_a_link_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "state.db"
    open_store(f"sqlite:///{db}").close()
    journal = tmp_path / "j"
    journal.write_text('{"t": 1790000000.0, "model": "voice", "busy_s": 0.1}\n')
    os.symlink(journal, tmp_path / "link")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG.read_text() + f"store: {{url: 'sqlite:///{db}', journal: '{journal}'}}\n")
    assert main(["trace", "export", "--config", str(cfg), "--out", str(tmp_path / "link")]) == 2
    assert "is the service's request journal" in capsys.readouterr().err
    assert journal.read_text().startswith('{"t": 1790000000.0')


def test_another_file_is_written(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    open_store(f"sqlite:///{db}").close()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG.read_text() + f"store: {{url: 'sqlite:///{db}', journal: '{tmp_path}/j'}}\n")
    assert main(["trace", "export", "--config", str(cfg), "--out", str(tmp_path / "week.jsonl")]) == 0
    assert (tmp_path / "week.jsonl").exists()
