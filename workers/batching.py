"""Dynamic batching: concurrent requests for one model run as one call of the model.

A model opts in with `max_batch` > 1 in its config (Triton's `max_batch_size` with its dynamic
batcher): its first dimension, on every input and output, is the batch (rows), and rows are
independent of each other. Requests that arrive together are then stacked along that dimension,
run once and split again, so the model's per-call overhead (Python, kernel launches) is paid once
per batch, not once per request. Plain numpy: no torch, no Ray.

Which requests go together: those with the same input names, and per input the same dtype and
the same shape after the first dimension, whose rows add up to at most `max_batch`, in arrival
order. A request that cannot go with any (a scalar input, inputs of unequal row counts) runs alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Inputs = dict[str, np.ndarray]


def rows_of(inputs: Inputs) -> int | None:
    """The batch size of one request (the common first dimension of its inputs), or None when it has
    no such dimension (no inputs, a 0-d input, or inputs that disagree on it)."""
    rows = None
    for a in inputs.values():
        if a.ndim == 0:
            return None
        if rows is None:
            rows = int(a.shape[0])
        elif int(a.shape[0]) != rows:
            return None
    return rows if rows else None


def signature(inputs: Inputs) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """What requests must share to be stacked: per input its name, dtype and shape after dim 0."""
    return tuple(sorted((k, a.dtype.str, tuple(a.shape[1:])) for k, a in inputs.items()))


def plan(items: Sequence[Inputs], max_batch: int) -> list[list[int]]:
    """Groups of indices into `items` to run as one call each, every index exactly once, groups in
    order of their first request. A group of one is a request that runs alone."""
    groups: list[list[int]] = []
    open_: dict[tuple[tuple[str, str, tuple[int, ...]], ...], tuple[list[int], int]] = {}
    for i, x in enumerate(items):
        rows = rows_of(x) if max_batch > 1 else None
        if rows is None or rows > max_batch:
            groups.append([i])
            continue
        sig = signature(x)
        cur = open_.get(sig)
        if cur is not None and cur[1] + rows <= max_batch:
            cur[0].append(i)
            open_[sig] = (cur[0], cur[1] + rows)
            continue
        group = [i]
        groups.append(group)
        open_[sig] = (group, rows)
    return groups


def stack(items: Sequence[Inputs]) -> tuple[Inputs, list[int]]:
    """One request of all rows of `items` (which share a signature), and each item's row count."""
    rows = [int(next(iter(x.values())).shape[0]) for x in items]
    names = items[0].keys()
    return {k: np.concatenate([x[k] for x in items], axis=0) for k in names}, rows


def split(outputs: dict[str, np.ndarray], rows: list[int]) -> list[dict[str, np.ndarray]] | None:
    """Each request's share of a batched call's outputs, or None when an output does not have one
    row per input row (the model does not batch the way `max_batch` says: run the items alone)."""
    total = sum(rows)
    for a in outputs.values():
        if a.ndim == 0 or int(a.shape[0]) != total:
            return None
    cuts = np.cumsum(rows)[:-1]
    parts = {k: np.split(a, cuts, axis=0) for k, a in outputs.items()}
    return [{k: parts[k][j] for k in outputs} for j in range(len(rows))]


__all__ = ["plan", "rows_of", "signature", "split", "stack"]
