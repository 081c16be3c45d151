"""Audit lines: one JSON object per event, to stderr or a 0600 file, and never a secret anywhere."""

from __future__ import annotations

import io
import json
import logging
import os
import pathlib
from datetime import UTC, datetime

import pytest

from acp_server.auth.audit import EVENTS, AuditLog
from acp_server.auth.http_rules import bearer_subprotocol, http_identity
from acp_server.auth.ratelimit import AuthFailureLimiter
from acp_server.auth.tokens import TokenFileError, TokenStore, load_tokens, parse_tokens, write_tokens
from acp_server.cli import main

CLOCK = datetime(2026, 12, 1, 10, 0, 0, 123456, tzinfo=UTC)


def test_lines_are_json_with_a_timestamp_and_the_event(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "audit.log")
    audit = AuditLog(path, clock=lambda: CLOCK)
    audit.auth_ok(token_id="ci", tenant="acme", transport="tcp", source="10.0.0.7")
    audit.auth_failed(reason="unknown_or_expired", transport="http", source="10.0.0.8")
    audit.auth_refused(transport="tcp", source="10.0.0.8", retry_after_ms=1500)
    audit.token_revoked(token_id="ci", evicted=2)
    audit.token_expired(token_id="old")
    audit.tokens_reloaded(path="/t.toml", added=1, removed=1, changed=0)
    audit.tokens_reload_failed(path="/t.toml", detail="not valid TOML")
    audit.admin_act(token_id="root", action="session/list", tenant="beta")
    audit.close()
    assert os.stat(path).st_mode & 0o777 == 0o600
    lines = [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]
    assert [line["event"] for line in lines] == list(EVENTS)
    assert all(line["ts"] == "2026-12-01T10:00:00.123Z" for line in lines)
    assert lines[0] == {"ts": "2026-12-01T10:00:00.123Z", "event": "auth_ok", "tokenId": "ci", "tenant": "acme",
                        "transport": "tcp", "source": "10.0.0.7"}
    assert lines[2]["retryAfterMs"] == 1500 and lines[3]["evicted"] == 2
    assert "target" not in lines[7]  # absent fields are left out
    # appending: a second log on the same file keeps the first lines
    again = AuditLog(path)
    again.token_revoked(token_id="x")
    again.close()
    assert len(pathlib.Path(path).read_text().splitlines()) == len(EVENTS) + 1


def test_stderr_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    AuditLog().auth_failed(reason="missing", transport="ws", source=None)
    line = json.loads(capsys.readouterr().err)
    assert line["event"] == "auth_failed" and line["reason"] == "missing" and "source" not in line


def test_unknown_failure_reasons_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown failure reason"):
        AuditLog(stream=io.StringIO()).auth_failed(reason="the secret was abc", transport="tcp", source=None)


def test_a_broken_stream_warns_once_and_does_not_raise(caplog: pytest.LogCaptureFixture) -> None:
    stream = io.StringIO()
    audit = AuditLog(stream=stream)
    stream.close()
    with caplog.at_level(logging.WARNING):
        audit.token_revoked(token_id="a")
        audit.token_revoked(token_id="b")
    assert len([r for r in caplog.records if "audit lines are being lost" in r.message]) == 1


def test_secrets_never_reach_logs_errors_or_audit_lines(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Every path a secret travels here (token add, list, revoke, reload, bad files, HTTP checks, failure
    counting, audit), with everything written collected and searched for each secret."""
    caplog.set_level(logging.DEBUG)
    tokens = str(tmp_path / "tokens.toml")
    audit_path = str(tmp_path / "audit.log")
    written: list[str] = []
    secrets_: list[str] = []
    for tenant in ("acme", "beta"):
        assert main(["token", "add", "--tenant", tenant, "--file", tokens, "--scope", "admin"]) == 0
        out, err = capsys.readouterr()
        secrets_.append(out.splitlines()[-1])
        written += [out.rsplit(secrets_[-1], 1)[0], err]  # the one place a secret may appear: add's last line
    store = TokenStore.from_file(tokens)
    audit = AuditLog(audit_path)
    limiter = AuthFailureLimiter()
    for secret in secrets_:
        for attempt in (secret, secret[:-1], secret + "x"):
            for result in (
                http_identity(store, authorization=f"Bearer {attempt}"),
                http_identity(store, authorization=None, ws_protocols=f"acp.v1, {bearer_subprotocol(attempt)}"),
            ):
                written.append(repr(result))
                if result.identity is not None:
                    audit.auth_ok(token_id=result.identity.token_id or "", tenant=result.identity.tenant or "",
                                  transport="http", source="10.0.0.9")
                else:
                    limiter.failed("10.0.0.9")
                    audit.auth_failed(reason="unknown_or_expired", transport="http", source="10.0.0.9")
    # a file with a secret pasted where its digest belongs: the error does not quote it
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[tokens.a]\nsha256 = "{secrets_[0]}"\ntenant = "t"\n')
    os.chmod(bad, 0o600)
    with pytest.raises(TokenFileError) as info:
        load_tokens(str(bad))
    written.append(str(info.value))
    os.chmod(tokens, 0o644)
    result = store.reload()
    assert result.error is not None
    audit.tokens_reload_failed(path=tokens, detail=result.error)
    os.chmod(tokens, 0o600)
    assert main(["token", "list", "--file", tokens]) == 0
    assert main(["token", "revoke", load_tokens(tokens).popitem()[0], "--file", tokens]) == 0
    write_tokens(tokens, parse_tokens(pathlib.Path(tokens).read_text()).values())
    reload = store.reload()
    for token_id in reload.removed:
        audit.token_revoked(token_id=token_id)
    audit.close()
    out, err = capsys.readouterr()
    written += [out, err, pathlib.Path(audit_path).read_text(), pathlib.Path(tokens).read_text(), caplog.text]
    assert len(pathlib.Path(audit_path).read_text().splitlines()) >= 14
    for secret in secrets_:
        for text in written:
            assert secret not in text
            assert bearer_subprotocol(secret) not in text
