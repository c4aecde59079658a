"""Review 21, a walkthrough of models brought as their own files (safetensors + a factory module):

- A checkpoint path that was a FIFO held the load's open until something wrote into it: `measure`
  hung, and in the service the load was abandoned at its timeout but every later load of the model
  waited behind it, a good file put in place included, until a restart. Refused at once now.
- A file with bytes after its last tensor (or between two) loaded, all of it read and held in
  memory, and `measure --write-config` wrote its size as the model's; the reference reader refuses it.
- A factory whose build() failed stayed imported (sys.modules): fixed on disk, it was never read
  again, and every load failed as the first did until a restart."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from live_helpers import in_time
from safetensors import SafetensorError
from safetensors.torch import load_file

from workers import protocol as P
from workers.demo import write_tiny_mlp
from workers.host import DeviceHost
from workers.st_io import CheckpointError, read_safetensors, write_safetensors


def _spec(path: Path, factory: str = "workers.demo:tiny_mlp") -> P.ModelSpec:
    return P.ModelSpec(
        "m", "safetensors-module", {"factory": factory, "path": str(path), "kwargs": {"width": 8}}
    )


def test_a_fifo_checkpoint_is_refused_at_once_and_a_good_file_then_loads(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    os.mkfifo(path)
    got = in_time(lambda: read_safetensors(path))
    assert isinstance(got, CheckpointError) and "is a FIFO, not a safetensors file" in str(got), got
    host = DeviceHost("cpu0", "cpu", node="test")
    r = in_time(lambda: host.apply(P.Load(_spec(path)), "load"))
    assert (r.ok, r.error_code) == (False, P.BAD_CHECKPOINT), r.error
    assert str(path) in r.error and "FIFO" in r.error
    path.unlink()
    write_tiny_mlp(path, 8)
    assert in_time(lambda: host.apply(P.Load(_spec(path)), "load again")).ok


def test_bytes_that_belong_to_no_tensor_are_refused_as_the_reference_reader_refuses_them(
    tmp_path: Path,
) -> None:
    path = tmp_path / "trailing.safetensors"
    write_safetensors({"w": torch.ones(4), "b": torch.zeros(2)}, path)
    assert set(read_safetensors(path)[0]) == {"w", "b"}
    with path.open("ab") as f:
        f.write(b"\0" * 4096)
    with pytest.raises(SafetensorError):
        load_file(path)
    with pytest.raises(CheckpointError) as e:
        read_safetensors(path)
    assert "4096" in str(e.value) and "after the last tensor" in str(e.value), e.value


def test_a_factory_fixed_after_its_build_failed_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "review21_factory.py"
    imports = tmp_path / "imports.log"
    head = f"with open({str(imports)!r}, 'a') as _f:\n    _f.write('imported\\n')\n\n\n"
    module.write_text(head + "def build(**kw):\n    raise ValueError('not written yet')\n")
    monkeypatch.delitem(__import__("sys").modules, "review21_factory", raising=False)
    path = write_tiny_mlp(tmp_path / "tiny.safetensors", 8)
    host = DeviceHost("cpu0", "cpu", node="test")
    spec = _spec(path, "review21_factory:build")
    r = host.apply(P.Load(spec), "load")
    assert not r.ok and "not written yet" in r.error, r.error
    # the file unchanged (the fix was elsewhere, say): not imported again (its top-level code runs once)
    r = host.apply(P.Load(spec), "load, the file unchanged")  # (another op: an op id is answered once)
    assert not r.ok and imports.read_text().splitlines() == ["imported"]
    module.write_text(
        head
        + "from workers.demo import tiny_mlp\n\n\ndef build(**kw):\n    # fixed\n    return tiny_mlp(**kw)\n"
    )
    r = host.apply(P.Load(spec), "load again")
    assert r.ok, r.error
    assert imports.read_text().splitlines() == ["imported", "imported"]


def test_a_model_read_into_host_ram_is_booked_at_the_bytes_it_holds_there(tmp_path: Path) -> None:
    """A load straight into host RAM kept the config's `memory` as the model's size: two models of
    hundreds of MiB estimated at 1 MiB were booked as 2 MiB of host RAM. Now the host bytes the load
    measured replace the estimate (until a device load measures it)."""
    import asyncio

    from live_helpers import local_config, until

    from manager.live import LiveManager
    from manager.policy.types import Tier
    from manager.workers_bridge import create_pool

    config = local_config(tmp_path, ("voice", "embed"))
    models = [
        m.model_copy(update={"memory": 2**20, "prewarm": False}) if m.name == "embed" else m
        for m in config.models
    ]
    config = config.model_copy(update={"models": models})

    async def main() -> None:
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            m = lm.engine.models["embed"]
            assert m.weights == 2**20
            before = lm.engine.host.used
            await lm.preload("embed", "host")
            await until(lambda: not lm.host_read_pending("embed"), "the read into host RAM answered")
            assert m.tier == Tier.HOST
            assert m.weights > 50 * 2**20, m.weights  # all-MiniLM-L6-v2: ~87 MiB of tensors
            assert lm.engine.host.used == before + m.weights
        finally:
            await lm.stop()
            pool.close()

    asyncio.run(main())


def test_a_read_into_host_ram_checks_the_checkpoint_against_the_module(tmp_path: Path) -> None:
    """A load into host RAM took a checkpoint another module's (an extra tensor, a wrong shape),
    held its bytes and said the model's earlier failure was over; the next request's load failed.
    Now the read is refused as the device load refuses it, naming the file."""
    path = tmp_path / "other.safetensors"
    write_safetensors(
        {"0.weight": torch.zeros(8, 8), "0.bias": torch.zeros(8), "extra": torch.zeros(2)}, path
    )
    host = DeviceHost("cpu0", "cpu", node="test")
    r = host.apply(P.Load(_spec(path), "host"), "to host")
    assert (r.ok, r.error_code) == (False, P.BAD_CHECKPOINT), r.error
    assert str(path) in r.error and "checkpoint does not match the module" in r.error, r.error
    assert "m" not in host.status().models or host.status().models["m"].tier == "disk"
    good = write_tiny_mlp(tmp_path / "good.safetensors", 8)
    r = host.apply(P.Load(_spec(good), "host"), "to host again")
    assert r.ok and r.to_tier == "host", r.error
    wrong = write_tiny_mlp(tmp_path / "wide.safetensors", 16)  # the shapes of another width
    r = host.apply(P.Load(_spec(wrong), "gpu"), "to the device")
    assert (r.ok, r.error_code) == (False, P.BAD_CHECKPOINT), r.error
    assert str(wrong) in r.error and "has shape" in r.error, r.error


def test_a_fifo_torchscript_archive_is_refused_at_once(tmp_path: Path) -> None:
    """The TorchScript adapter opened its archive as the safetensors reader did: a FIFO held the
    load until something wrote into it."""
    path = tmp_path / "vad.pt"
    os.mkfifo(path)
    spec = P.ModelSpec("ts", "torchscript", {"path": str(path)})
    host = DeviceHost("cpu0", "cpu", node="test")
    r = in_time(lambda: host.apply(P.Load(spec), "load"))
    assert (r.ok, r.error_code) == (False, P.BAD_CHECKPOINT), r.error
    assert "is a FIFO, not a TorchScript archive" in r.error, r.error
