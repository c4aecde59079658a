"""One factory for the policy family: `create_policy(name, requests=...)`."""

from __future__ import annotations

from collections.abc import Sequence

from manager.policy.base import Policy
from manager.policy.baselines import GDSF, HistogramPolicy, LruKeepAlive
from manager.policy.oracle import OraclePolicy
from manager.policy.residency import ResidencyPolicy
from manager.policy.types import Request

POLICY_NAMES = ("residency", "lru-keepalive", "histogram", "gdsf", "oracle")


def create_policy(name: str, requests: Sequence[Request] | None = None) -> Policy:
    """A fresh policy. `oracle` needs the whole trace (`requests`); the others ignore it."""
    if name == "residency":
        return ResidencyPolicy()
    if name == "lru-keepalive":
        return LruKeepAlive()
    if name == "histogram":
        return HistogramPolicy()
    if name == "gdsf":
        return GDSF()
    if name == "oracle":
        if requests is None:
            raise ValueError("policy 'oracle' sees the future: it needs the whole trace")
        return OraclePolicy(requests)
    raise ValueError(f"unknown policy '{name}' (known: {', '.join(POLICY_NAMES)})")
