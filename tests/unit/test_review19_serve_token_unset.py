"""Review 19: `serve` refused a listen address beyond loopback with "set server.auth_token_env and put
a bearer token in that environment variable" when the config already named the variable and only the
variable was unset: the fix it gave was wrong. It now names the variable that is not set (as `residency
config check` words it), for `server.listen` and `server.metrics_listen`; with no variable named, the
message is as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from manager.api.runtime import ServeError
from manager.api.server import auth_token
from manager.config import Config, load_config

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-cpu.yaml"
VAR = "RESIDENCY_R19_WALK_TOKEN"


def config(**server: Any) -> Config:
    base = load_config(CONFIG)
    return base.model_copy(update={"server": base.server.model_copy(update=server)})


def refusal(cfg: Config) -> str:
    with pytest.raises(ServeError) as e:
        auth_token(cfg)
    return str(e.value)


def test_listen_beyond_loopback_with_the_variable_unset_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VAR, raising=False)
    msg = refusal(config(listen="0.0.0.0:50613", auth_token_env=VAR))
    assert msg.startswith("server.listen '0.0.0.0:50613' is beyond loopback")
    assert f"server.auth_token_env names ${VAR}, which is not set" in msg
    assert "set server.auth_token_env" not in msg  # it is set: that was the wrong fix


def test_metrics_beyond_loopback_with_the_variable_unset_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VAR, raising=False)
    msg = refusal(config(listen="127.0.0.1:50613", metrics_listen="0.0.0.0:9613", auth_token_env=VAR))
    assert msg.startswith("server.metrics_listen '0.0.0.0:9613' is beyond loopback")
    assert f"server.auth_token_env names ${VAR}, which is not set" in msg
    assert "set server.auth_token_env" not in msg


def test_with_no_variable_named_the_fix_is_to_name_one(monkeypatch: pytest.MonkeyPatch) -> None:
    msg = refusal(config(listen="0.0.0.0:50613", auth_token_env=None))
    assert "set server.auth_token_env and put a bearer token in that environment variable" in msg
    msg = refusal(config(listen="127.0.0.1:50613", metrics_listen="0.0.0.0:9613", auth_token_env=None))
    assert "set server.auth_token_env and put a bearer token in that environment variable" in msg
    monkeypatch.setenv(VAR, "s3cret-token")
    assert auth_token(config(listen="0.0.0.0:50613", metrics_listen="0.0.0.0:9613", auth_token_env=VAR)) == (
        "s3cret-token"
    )
