"""Review 16: Triton's `priority` parameter above the number of classes. It was taken as the lowest
class (background here: a request that may evict nothing and waits), where Triton takes a level above
its levels as the model's default priority (`InferenceRequest::SetPriority`). Now the model's own
class, as for 0. The servicer's manager is a stand-in holding only the config's classes (the
mapping reads nothing else)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from manager.api.oip import InferenceServicer
from residency_proto.inference import grpc_service_pb2 as pb

CLASSES = ["realtime", "interactive", "background"]


def _servicer() -> InferenceServicer:
    config = SimpleNamespace(classes=[SimpleNamespace(name=c) for c in CLASSES])
    return InferenceServicer(SimpleNamespace(config=config), describe=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("priority", "cls"),
    [(0, None), (1, "realtime"), (2, "interactive"), (3, "background"), (4, None), (2**40, None)],
)
def test_levels_map_to_classes_and_above_them_to_the_models_own(priority: int, cls: str | None) -> None:
    request = pb.ModelInferRequest(model_name="voice")
    request.parameters["priority"].uint64_param = priority
    assert _servicer()._class_of(request) == cls
