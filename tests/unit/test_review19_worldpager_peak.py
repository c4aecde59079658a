"""The GPU lease undercounted the device tier's peak: `TransferHandler.memory` concatenated a step's
uploaded slots into new tensors (one more buffer's worth, ~1.5x the lease with both buffers full) while
the lease (`gpu_budget_bytes`) counted only the two retrieval buffers; and each upload staged the whole
payload (a pageable copy plus a pinned one on CUDA) outside the host budget. Now a step's slots are
uploaded into one contiguous buffer per layer and handed to the model as views of it (memory()
allocates nothing), and uploads go page by page (one layer's K/V and one page of staging at a time):
the peak is the two buffers plus one layer, and the staging is two pages. Real torch tensors on CPU;
peaks computed from the tensors' storages and shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from worldpager.layout import SegmentLayout
from worldpager.model import TinyCausalWan
from worldpager.session import SESSION_PRESETS, Session
from worldpager.trajectory import yaw_sweep_trajectory
from worldpager.transfer import TransferHandler

CFG = SESSION_PRESETS["micro"].on_the_fly()


def _storages(ts: Any) -> dict[int, int]:
    """data_ptr -> nbytes of the storages under the tensors in ``ts`` (nested lists / tuples / dicts)."""
    out: dict[int, int] = {}

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            s = x.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)

    walk(ts)
    return out


def test_memory_hands_the_step_its_buffer_without_a_second_copy(tmp_path: Path) -> None:
    torch.manual_seed(0)
    s = Session(
        TinyCausalWan(CFG), host_budget_bytes=1 << 20, log_dir=tmp_path / "s", retrieval_k=2, gpu_slots=2
    )
    h = s.handler
    seen: list[tuple[int, int, int]] = []  # (slots handed out, extra bytes memory() allocated, buffers)
    real = h.memory

    def memory(step: int) -> Any:
        mem, ids = real(step)
        if mem is not None:
            with h._cond:
                buffers = _storages([b.store for b in h._steps.values()])
            extra = sum(n for p, n in _storages(mem).items() if p not in buffers)
            seen.append((len(ids), extra, sum(buffers.values())))
        return mem, ids

    h.memory = memory  # type: ignore[method-assign]
    with s:
        s.run(yaw_sweep_trajectory(14))
        budget = s.gpu_budget_bytes
    assert any(n == 2 for n, _, _ in seen), "the trajectory should fill a buffer's two slots"
    for n, extra, buffers in seen:
        assert extra == 0, f"memory() allocated {extra} bytes for {n} slots"
        assert buffers + extra <= budget  # the device tier's peak within the lease


def test_a_buffer_with_a_lost_slot_is_packed_in_place() -> None:
    t = 3
    store = [(torch.arange(4 * t, dtype=torch.float32).reshape(1, 4 * t, 1, 1), torch.zeros(1, 4 * t, 1, 1))]
    want = torch.cat([store[0][0][:, 1 * t : 2 * t], store[0][0][:, 3 * t : 4 * t]], dim=1).clone()
    ptr = store[0][0].untyped_storage().data_ptr()
    mem = TransferHandler._packed(store, [1, 3], t)
    assert torch.equal(mem[0][0], want) and mem[0][0].shape[1] == 2 * t
    assert mem[0][0].untyped_storage().data_ptr() == ptr  # in place: no new buffer


def test_an_upload_stages_and_decodes_one_page_at_a_time() -> None:
    layout = SegmentLayout.from_config(SESSION_PRESETS["tiny"], "bf16")  # 32 layers
    assert TransferHandler.staging_bytes(layout, cuda=True) == 2 * layout.page_nbytes
    assert TransferHandler.staging_bytes(layout, cuda=False) == layout.page_nbytes
    # was a pageable and a pinned copy of the whole payload: 2 x 3.375 MiB; now 2 x 108 KiB
    assert layout.layers * TransferHandler.staging_bytes(layout, cuda=True) == 2 * layout.payload_nbytes
