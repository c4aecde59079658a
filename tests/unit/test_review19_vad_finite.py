"""Review 19's user walkthrough: silero-vad answered OK to audio of NaN or inf samples (`speech_prob
[nan]`), though such input is no audio at all (a client's bug, a broken microphone driver). Now it is
refused BAD_INPUT (INVALID_ARGUMENT to the client), naming the input, how many samples are not finite
and the first one's index; the model keeps serving. Real silero-vad on an in-process device host."""

from __future__ import annotations

import numpy as np
import pytest

from workers import protocol as P
from workers.host import DeviceHost


@pytest.fixture
def host() -> DeviceHost:
    h = DeviceHost("cpu0", "cpu", node="review19")
    assert h.apply(P.Load(P.ModelSpec("voice", "silero-vad")), "voice").ok
    return h


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_audio_is_refused_naming_it(host: DeviceHost, bad: float) -> None:
    audio = np.zeros(1024, np.float32)
    audio[700:705] = bad
    r = host.infer("voice", {"audio": audio})
    assert not r.ok and r.error_code == P.BAD_INPUT, r.error
    assert "input 'audio' has 5 samples that are not finite (NaN or inf), the first at index 700" in (
        r.error or ""
    )
    ok = host.infer("voice", {"audio": np.zeros(1024, np.float32)})  # still serving, its state not poisoned
    assert ok.ok
    dtype, shape, raw = ok.outputs["speech_prob"]
    assert (dtype, shape) == ("FP32", (2,)) and np.isfinite(np.frombuffer(raw, np.float32)).all()
