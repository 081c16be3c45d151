"""The admission policy and metrics surface of ``acp-server serve``: flags and the ``[admission]`` /
``[metrics]`` tables parse into ``PolicyLimits`` (flags over the file), bad values exit 2 naming the
flag or key and what it accepts, and a real server process serves ``/metrics``."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from acp_server import cli
from acp_server.admission.policy import DEFAULT_CLASS_SHARES, PolicyLimits
from acp_server.config import ConfigError, parse_config
from acp_server.server import ListenAddress

from .test_e2e_sdk import START_TIMEOUT_S, ServerProcess

METRICS_PREFIX = "acp-server: metrics on "


def parsed(*argv: str) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = cli.build_parser()
    return parser.parse_args(["serve", *argv]), parser


def policy(*argv: str) -> PolicyLimits:
    return cli.policy_from(*parsed(*argv))


def metrics(*argv: str) -> tuple[ListenAddress | None, bool]:
    return cli.metrics_from(*parsed(*argv))


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "acp-server.toml"
    path.write_text(text)
    return str(path)


# --- accepted --------------------------------------------------------------------------------------


def test_cli_policy_defaults_are_off() -> None:
    """No flag, no file: the built-in PolicyLimits (nothing limited) and no metrics endpoint."""
    assert policy() == PolicyLimits()
    assert not policy().enabled
    assert metrics() == (None, False)


def test_cli_policy_flags_parse_into_policy_limits() -> None:
    """Every flag lands in its field; the others keep their defaults."""
    got = policy(
        "--max-running-prompts", "8",
        "--max-queued-prompts", "0",
        "--tenant-max-running", "3",
        "--interactive-max-wait-ms", "500",
        "--aging-s", "2.5",
        "--admission-mode", "observe",
    )  # fmt: skip
    assert got == PolicyLimits(
        max_running_prompts=8,
        max_queued_prompts=0,
        tenant_max_running=3,
        interactive_max_wait_ms=500,
        aging_s=2.5,
        mode="observe",
    )
    assert policy("--aging-s", "0").aging_s == 0  # 0 turns aging off
    assert metrics("--metrics-listen", "tcp://127.0.0.1:9464", "--metrics-tenant-labels") == (
        ListenAddress("tcp", host="127.0.0.1", port=9464),
        True,
    )


def test_cli_policy_config_file_then_flags_over_it(tmp_path: Path) -> None:
    """The ``[admission]`` and ``[metrics]`` tables set the policy; a flag given wins over its key."""
    path = write(
        tmp_path,
        "[admission]\n"
        "max_running_prompts = 20\n"
        "max_queued_prompts = 50\n"
        "tenant_max_running = 6\n"
        "tenant_overrides = { tenantA = 4, vip = 0 }\n"
        "class_shares = { interactive = 70, background = 30 }\n"
        "interactive_max_wait_ms = 1500\n"
        "aging_s = 10\n"
        'mode = "observe"\n'
        "[metrics]\n"
        'listen = "tcp://127.0.0.1:0"\n'
        "tenant_labels = true\n",
    )
    from_file = PolicyLimits(
        max_running_prompts=20,
        max_queued_prompts=50,
        tenant_max_running=6,
        tenant_overrides={"tenantA": 4, "vip": 0},
        class_shares={"interactive": 70, "background": 30},
        interactive_max_wait_ms=1500,
        aging_s=10,
        mode="observe",
    )
    assert policy("--config", path) == from_file
    assert metrics("--config", path) == (ListenAddress("tcp", host="127.0.0.1", port=0), True)
    over = policy(
        "--config", path, "--max-running-prompts", "4", "--admission-mode", "enforce", "--aging-s", "0"
    )
    assert (over.max_running_prompts, over.mode, over.aging_s) == (4, "enforce", 0)
    assert over.tenant_overrides == from_file.tenant_overrides and over.max_queued_prompts == 50
    assert metrics("--config", path, "--metrics-listen", "tcp://127.0.0.1:9")[0] == ListenAddress(
        "tcp", host="127.0.0.1", port=9
    )
    # A file without class_shares keeps the default shares.
    assert policy("--config", write(tmp_path, "[admission]\nmax_running_prompts = 2\n")).class_shares == dict(
        DEFAULT_CLASS_SHARES
    )


# --- refused ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--max-running-prompts", "-1"],
            "--max-running-prompts must be a non-negative integer (0 disables the limit)",
        ),
        (["--max-running-prompts", "two"], "--max-running-prompts must be a non-negative integer"),
        (
            ["--max-queued-prompts", "1.5"],
            "--max-queued-prompts must be a non-negative integer (0 = no waiting room)",
        ),
        (["--tenant-max-running", "-2"], "--tenant-max-running must be a non-negative integer"),
        (
            ["--interactive-max-wait-ms", "x"],
            "--interactive-max-wait-ms must be a non-negative integer (0 = any wait)",
        ),
        (["--aging-s", "-1"], "--aging-s must be a non-negative number of seconds (0 turns aging off)"),
        (["--aging-s", "nan"], "--aging-s must be a non-negative number of seconds"),
        (["--aging-s", "inf"], "--aging-s must be a non-negative number of seconds"),
        (
            ["--admission-mode", "strict"],
            "--admission-mode: invalid choice: 'strict' (choose from enforce, observe)",
        ),
        (
            ["--metrics-listen", "unix:/tmp/m.sock"],
            "--metrics-listen 'unix:/tmp/m.sock': metrics are served over HTTP",
        ),
        (
            ["--metrics-listen", "tcp://127.0.0.1"],
            "--metrics-listen 'tcp://127.0.0.1' is not of the form tcp://HOST:PORT",
        ),
        (
            ["--metrics-listen", "tcp://0.0.0.0:0"],
            "--metrics-listen tcp://0.0.0.0:0: 0.0.0.0 is not a loopback address",
        ),
        (["--metrics-tenant-labels"], "--metrics-tenant-labels needs --metrics-listen"),
    ],
)
def test_cli_policy_bad_flag_exits_2_naming_it(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad value is a usage error: exit 2, the message names the flag and what it accepts."""
    with pytest.raises(SystemExit) as exc_info:
        cli.main(["serve", "--ephemeral", "--listen", "tcp://127.0.0.1:0", *argv])
    assert exc_info.value.code == 2
    err = capsys.readouterr().err
    assert expected.replace("(choose from enforce, observe)", "") in err, err
    if "choose from" in expected:
        assert "enforce" in err and "observe" in err


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "[admission]\nmax_queued_prompts = -1\n",
            "admission.max_queued_prompts must be a non-negative integer",
        ),
        (
            "[admission]\nmax_running_prompts = true\n",
            "admission.max_running_prompts: Expected `int`, got `bool`",
        ),
        (
            '[admission]\nmode = "loud"\n',
            'admission.mode: Invalid enum value \'loud\' (accepted: "enforce", "observe")',
        ),
        (
            "[admission]\nclass_shares = { vip = 1 }\n",
            "admission.class_shares keys must be among critical, interactive",
        ),
        (
            "[admission]\nclass_shares = { bulk = 0 }\n",
            "admission.class_shares must give at least one class a positive share",
        ),
        (
            "[admission]\ntenant_overrides = { a = -1 }\n",
            'admission.tenant_overrides["a"] must be a non-negative integer',
        ),
        ("[admission]\naging_s = -5\n", "admission.aging_s must be a non-negative number of seconds"),
        ("[admission]\nseats = 3\n", "admission.seats: unknown key"),
        ("[metrics]\ntenant_labels = 1\n", "metrics.tenant_labels: Expected `bool`, got `int`"),
    ],
)
def test_cli_policy_bad_config_names_the_key(
    text: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad ``[admission]`` / ``[metrics]`` value: ConfigError naming the key; ``serve`` exits 2 with it."""
    with pytest.raises(ConfigError) as info:
        parse_config(text, "my.toml")
    assert str(info.value).startswith("my.toml: ") and expected in str(info.value)
    path = write(tmp_path, text)
    with pytest.raises(SystemExit) as exc_info:
        cli.main(["serve", "--ephemeral", "--config", path])
    assert exc_info.value.code == 2
    assert f"--config {path}: {expected}" in capsys.readouterr().err


def test_cli_policy_bad_metrics_listen_in_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``[metrics] listen`` is checked like the flag, and named as the file's key."""
    path = write(tmp_path, '[metrics]\nlisten = "unix:/tmp/m.sock"\n')
    with pytest.raises(SystemExit) as exc_info:
        cli.main(["serve", "--ephemeral", "--config", path])
    assert exc_info.value.code == 2
    assert (
        f"--config {path}: metrics.listen 'unix:/tmp/m.sock': metrics are served over HTTP"
        in capsys.readouterr().err
    )


def test_cli_policy_limits_error_is_mapped_to_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """A value PolicyLimits refuses (here one that slipped past argparse) is reported under its flag."""
    args, parser = parsed("--max-running-prompts", "1")
    args.max_running_prompts = -3
    with pytest.raises(SystemExit) as exc_info:
        cli.policy_from(args, parser)
    assert exc_info.value.code == 2
    assert (
        "--max-running-prompts must be a non-negative integer (0 disables the limit); got -3"
        in capsys.readouterr().err
    )


def test_cli_policy_help_documents_the_flags() -> None:
    """``serve --help`` lists every new flag with its default."""
    run = subprocess.run(
        [sys.executable, "-m", "acp_server", "serve", "--help"], capture_output=True, text=True, timeout=20
    )
    assert run.returncode == 0
    for flag in (*cli.POLICY_FLAGS.values(), "--metrics-listen", "--metrics-tenant-labels"):
        assert flag in run.stdout
    assert "default 200" in run.stdout and "default 2000" in run.stdout and "default 30" in run.stdout


# --- end to end ------------------------------------------------------------------------------------


def wait_metrics_url(server: ServerProcess) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        line = server.next_stderr_line(deadline, "the 'metrics on' line")
        if line.startswith(METRICS_PREFIX):
            return line[len(METRICS_PREFIX) :]


def scrape(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=START_TIMEOUT_S) as response:
        assert response.status == 200
        return response.headers["content-type"], response.read().decode()


def rpc(stream: socket.socket, reader: object, request: dict[str, object]) -> dict[str, object]:
    """Send one request; read lines until its answer (notifications in between are skipped)."""
    stream.sendall(json.dumps(request).encode() + b"\n")
    for _ in range(1000):
        message = json.loads(reader.readline())  # type: ignore[attr-defined]
        if message.get("id") == request["id"]:
            return dict(message)
    raise AssertionError(f"no answer to {request['method']}")


def test_cli_policy_serve_prints_both_lines_and_serves_metrics() -> None:
    """``serve --listen tcp://..:0 --metrics-listen tcp://..:0 --max-running-prompts 2``: one listening
    line, one metrics line; a prompt run through the server shows up as an admission decision."""
    with ServerProcess(
        "--ephemeral",
        "--listen", "tcp://127.0.0.1:0",
        "--metrics-listen", "tcp://127.0.0.1:0",
        "--max-running-prompts", "2",
    ) as server:  # fmt: skip
        [url] = server.wait_listening()
        metrics_url = wait_metrics_url(server)
        assert metrics_url.startswith("http://127.0.0.1:") and metrics_url.endswith("/metrics")
        content_type, text = scrape(metrics_url)
        assert content_type.startswith("text/plain; version=0.0.4")
        assert "acp_server_admission_decisions_total" in text
        assert 'acp_server_admission_info{enabled="true",mode="enforce"} 1.0' in text
        assert "acp_server_admission_max_running_prompts 2.0" in text

        host, _, port = url.removeprefix("tcp://").rpartition(":")
        with socket.create_connection((host, int(port)), timeout=START_TIMEOUT_S) as conn:
            reader = conn.makefile("rb")
            assert "result" in rpc(
                conn,
                reader,
                {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1}},
            )
            new = rpc(
                conn,
                reader,
                {
                    "jsonrpc": "2.0",
                    "id": 2,
                    "method": "session/new",
                    "params": {"cwd": "/", "mcpServers": []},
                },
            )
            session_id = new["result"]["sessionId"]  # type: ignore[index]
            prompt = {"sessionId": session_id, "prompt": [{"type": "text", "text": "hi"}]}
            done = rpc(
                conn, reader, {"jsonrpc": "2.0", "id": 3, "method": "session/prompt", "params": prompt}
            )
            assert done["result"]["stopReason"] == "end_turn"  # type: ignore[index]
        _, text = scrape(metrics_url)
        assert 'acp_server_admission_decisions_total{outcome="run",reason=""} 1.0' in text
        server.proc.terminate()
        assert server.proc.wait(10) == 0


def test_cli_policy_stdio_stdout_stays_clean_with_metrics() -> None:
    """Under ``--stdio`` stdout is the ACP stream: a scrape adds nothing to it."""
    with ServerProcess(
        "--stdio", "--metrics-listen", "tcp://127.0.0.1:0", stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as server:
        metrics_url = wait_metrics_url(server)
        scrape(metrics_url)
        assert server.proc.stdin is not None
        server.proc.stdin.write(
            b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":1}}\n'
        )
        server.proc.stdin.close()  # stdin EOF without listeners: the server exits
        assert server.proc.wait(10) == 0
        lines = server.rest_of_stdout()
        assert [json.loads(line)["id"] for line in lines] == [1]
