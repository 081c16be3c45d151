"""The ``openai`` backend kind in the configuration file and ``--agent NAME=openai:BASE_URL#MODEL``:
the keys, their refusals (naming the key), the shorthand over a file's table, and the key read from
the environment variable the config names (never from the file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from acp_server import cli
from acp_server.backends.openai import OpenAIBackend
from acp_server.backends.registry import build_backends
from acp_server.config import BackendConfig, ConfigError, parse_config

FULL = """
default_backend = "local"

[backends.local]
kind = "openai"
base_url = "http://127.0.0.1:8000/v1"
model = "my-model"
api_key_env = "MY_MODEL_KEY"
max_active = 2
max_waiting = 8
request_timeout_s = 60
max_attempts = 5
system_prompt = "Be brief."
extra_body = { temperature = 0.2, max_tokens = 512 }
context_tokens = 8192
images = true
max_tool_rounds = 4
"""

BAD = {
    "no model": ('[backends.x]\nkind = "openai"\nbase_url = "http://h/v1"\n', 'backends.x.model: required for kind = "openai"'),
    "no url": ('[backends.x]\nkind = "openai"\nmodel = "m"\n', "backends.x.base_url: required"),
    "not http": ('[backends.x]\nkind = "openai"\nbase_url = "ftp://h"\nmodel = "m"\n', "backends.x.base_url: must be an http"),
    "key in file": (
        '[backends.x]\nkind = "openai"\nbase_url = "http://h/v1"\nmodel = "m"\napi_key_env = "sk-abc-123"\n',
        "backends.x.api_key_env: the name of an environment variable",
    ),
    "zero attempts": (
        '[backends.x]\nkind = "openai"\nbase_url = "http://h/v1"\nmodel = "m"\nmax_attempts = 0\n',
        "backends.x.max_attempts: must be at least 1",
    ),
    "zero timeout": (
        '[backends.x]\nkind = "openai"\nbase_url = "http://h/v1"\nmodel = "m"\nrequest_timeout_s = 0\n',
        "backends.x.request_timeout_s: must be a positive number",
    ),
    "stream in extra_body": (
        '[backends.x]\nkind = "openai"\nbase_url = "http://h/v1"\nmodel = "m"\nextra_body = { stream = false }\n',
        "backends.x.extra_body.stream: set by the backend itself",
    ),
    "command for openai": (
        '[backends.x]\nkind = "openai"\nbase_url = "http://h/v1"\nmodel = "m"\ncommand = ["a"]\n',
        'backends.x.command: not used by kind = "openai"',
    ),
    "model for acp": ('[backends.x]\ncommand = ["a"]\nmodel = "m"\n', 'backends.x.model: only used by kind = "openai"'),
}


def test_the_full_openai_table_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    config = parse_config(FULL)
    local = config.backends["local"]
    assert local == BackendConfig(
        kind="openai", base_url="http://127.0.0.1:8000/v1", model="my-model", api_key_env="MY_MODEL_KEY",
        max_active=2, max_waiting=8, request_timeout_s=60, max_attempts=5, system_prompt="Be brief.",
        extra_body={"temperature": 0.2, "max_tokens": 512}, context_tokens=8192, images=True, max_tool_rounds=4,
    )
    monkeypatch.setenv("MY_MODEL_KEY", "sk-from-the-environment")
    backend = build_backends(config.backends)["local"]
    assert isinstance(backend, OpenAIBackend)
    assert backend._api_key == "sk-from-the-environment"
    assert (backend.max_attempts, backend.max_tool_rounds, backend.context_tokens, backend.images) == (5, 4, 8192, True)
    monkeypatch.delenv("MY_MODEL_KEY")
    assert build_backends(config.backends)["local"]._api_key is None


@pytest.mark.parametrize("case", sorted(BAD))
def test_openai_refusals_name_the_key(case: str) -> None:
    text, expected = BAD[case]
    with pytest.raises(ConfigError) as info:
        parse_config(text, "my.toml")
    assert expected in str(info.value)


def merged(*args: str) -> tuple[dict[str, BackendConfig], str]:
    parser = cli.build_parser()
    return cli.backends_from(parser.parse_args(["serve", *args]), parser)


def test_the_agent_shorthand(tmp_path: Path) -> None:
    backends, default = merged("--agent", "local=openai:http://127.0.0.1:8000/v1#my-model", "--default-backend", "local")
    assert default == "local"
    assert backends["local"] == BackendConfig(
        kind="openai", base_url="http://127.0.0.1:8000/v1", model="my-model", api_key_env="OPENAI_API_KEY"
    )
    # over the file's table, the shorthand replaces the URL and the model and keeps the rest
    path = tmp_path / "acp-server.toml"
    path.write_text(FULL)
    backends, _ = merged("--config", str(path), "--agent", "local=openai:http://10.0.0.2:11434/v1#llama3")
    assert (backends["local"].base_url, backends["local"].model) == ("http://10.0.0.2:11434/v1", "llama3")
    assert backends["local"].max_active == 2 and backends["local"].api_key_env == "MY_MODEL_KEY"


def test_a_malformed_shorthand_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        merged("--agent", "local=openai:http://127.0.0.1:8000/v1")
    assert "write openai:BASE_URL#MODEL" in capsys.readouterr().err
