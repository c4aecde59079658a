"""Domain errors of the service; `manager.api.errors` maps each to one gRPC status code."""

from __future__ import annotations


class ResidencyError(Exception):
    """Base: a message that says what is wrong and what to do about it."""


class ModelNotFound(ResidencyError):
    """Unknown model name (NOT_FOUND)."""


class InvalidRequest(ResidencyError):
    """Bad tensors, shapes, datatypes or parameters (INVALID_ARGUMENT)."""


class FailedPrecondition(InvalidRequest):
    """A well-formed request that the service's state forbids now, e.g. unloading or evicting a pinned
    model (FAILED_PRECONDITION, as gRPC names it: a client branching on INVALID_ARGUMENT reads "my
    request is malformed"). An InvalidRequest for callers that catch those."""


class PermissionDenied(ResidencyError):
    """A request for what only a holder of the admin token may ask (PERMISSION_DENIED): a class above
    its model's own while the service has a token. Not UNAUTHENTICATED: the call itself is allowed."""


class InsufficientCapacity(ResidencyError):
    """The model cannot fit, or a queue is full (RESOURCE_EXHAUSTED)."""


class WorkerUnavailable(ResidencyError):
    """The device host is down or the load failed (UNAVAILABLE)."""


class ModelFailed(ResidencyError):
    """The model ran and failed (its code raised), or it may have run and its answer was lost
    (INTERNAL). Not UNAVAILABLE: a client's retry policy retries that, and running a stateful model's
    request again (a voice detector, a world session's step) would step it twice."""


class DeadlineExceeded(ResidencyError):
    """The request's deadline passed while it waited (DEADLINE_EXCEEDED)."""


class Unauthenticated(ResidencyError):
    """Missing or wrong bearer token on an admin call (UNAUTHENTICATED)."""


class Unsupported(ResidencyError):
    """A request for something this service does not offer (Triton's UNSUPPORTED, UNIMPLEMENTED):
    another model repository than its one, say."""
