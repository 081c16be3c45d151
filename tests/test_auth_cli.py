"""``acp-server token add|revoke|list``: the secret printed once, only its digest stored, the file 0600."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from datetime import UTC, datetime

import pytest

from acp_server.auth.tokens import TokenStore, load_tokens
from acp_server.cli import main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["token", *argv])
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_add_prints_the_secret_alone_on_the_last_line_and_stores_its_digest(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "tokens.toml")
    code, out, _ = _run(
        capsys, "add", "--tenant", "acme", "--file", path, "--scope", "metrics", "--expires", "2999-01-01T00:00:00Z"
    )
    assert code == 0
    secret = out.splitlines()[-1]
    assert len(secret) == 43 and " " not in secret
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert secret not in pathlib.Path(path).read_text()
    identity = TokenStore.from_file(path).authenticate(secret)
    assert identity is not None and identity.tenant == "acme" and identity.scopes == {"metrics"}
    record = load_tokens(path)[identity.token_id or ""]
    assert record.expires == datetime(2999, 1, 1, tzinfo=UTC)
    assert identity.token_id is not None and identity.token_id in out


def test_add_appends_list_shows_no_secret_and_revoke_removes(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "tokens.toml")
    secrets_ = []
    for tenant, token_id in (("acme", "ci"), ("beta", "ops")):
        code, out, _ = _run(capsys, "add", "--tenant", tenant, "--file", path, "--id", token_id, "--scope", "admin")
        assert code == 0
        secrets_.append(out.splitlines()[-1])
    assert sorted(load_tokens(path)) == ["ci", "ops"]
    code, out, _ = _run(capsys, "list", "--file", path)
    assert code == 0
    lines = out.splitlines()
    assert [line.split("\t")[0] for line in lines] == ["ci", "ops"]
    assert "tenant=acme" in lines[0] and "scopes=admin" in lines[0] and "expires=never" in lines[0]
    text = pathlib.Path(path).read_text()
    for secret in secrets_:
        assert secret not in out
    for record in load_tokens(path).values():
        assert record.sha256.hex() not in out and record.sha256.hex() in text
    code, out, _ = _run(capsys, "revoke", "ci", "--file", path)
    assert code == 0 and "revoked ci" in out
    assert sorted(load_tokens(path)) == ["ops"]
    assert os.stat(path).st_mode & 0o777 == 0o600
    store = TokenStore.from_file(path)
    assert store.authenticate(secrets_[0]) is None and store.authenticate(secrets_[1]) is not None


def test_errors(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "tokens.toml")
    assert _run(capsys, "add", "--tenant", "a", "--file", path, "--id", "x")[0] == 0
    code, _, err = _run(capsys, "add", "--tenant", "a", "--file", path, "--id", "x")
    assert code == 1 and "'x' exists already" in err
    code, _, err = _run(capsys, "revoke", "nope", "--file", path)
    assert code == 1 and "no token 'nope'" in err and "tokens: x" in err
    os.chmod(path, 0o644)
    for argv in (("list", "--file", path), ("revoke", "x", "--file", path), ("add", "--tenant", "a", "--file", path)):
        code, out, err = _run(capsys, *argv)
        assert code == 1 and f"chmod 600 {path}" in err and out == ""
    code, _, err = _run(capsys, "list", "--file", str(tmp_path / "absent"))
    assert code == 1 and "No such file" in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--scope", "root"], "invalid choice: 'root'"),
        (["--expires", "2000-01-01T00:00:00Z"], "is in the past"),
        (["--expires", "2999-01-01T00:00:00"], "needs a UTC offset"),
        (["--id", "a.b"], "--id must be 1-64 letters"),
        (["--tenant", ""], "--tenant must be 1-128 printable"),
    ],
)
def test_bad_command_lines_exit_2(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    base = ["add", "--tenant", "a", "--file", str(tmp_path / "t.toml")]
    code, _, err = _run(capsys, *base, *argv)
    assert code == 2 and expected in err
    assert not (tmp_path / "t.toml").exists()


def test_the_installed_command(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "tokens.toml")
    done = subprocess.run(
        [sys.executable, "-m", "acp_server", "token", "add", "--tenant", "acme", "--file", path],
        capture_output=True,
        text=True,
        check=True,
    )
    secret = done.stdout.splitlines()[-1]
    assert TokenStore.from_file(path).authenticate(secret) is not None
    assert secret not in done.stderr
