"""The remote-bind rule: beyond loopback only with TLS and tokens, the refusal naming what is missing."""

from __future__ import annotations

import pytest

from acp_server.auth.binds import RemoteBindError, check_remote_bind, non_loopback


@pytest.mark.parametrize("addresses", [["127.0.0.1"], ["::1"], ["127.0.0.1", "::1"], ["::ffff:127.0.0.1"], []])
@pytest.mark.parametrize(("tls", "tokens"), [(False, False), (True, False), (False, True), (True, True)])
def test_loopback_needs_nothing(addresses: list[str], tls: bool, tokens: bool) -> None:
    check_remote_bind("--listen", "tcp://localhost:1", addresses, tls=tls, tokens=tokens)


def test_remote_with_both_is_accepted() -> None:
    check_remote_bind("--listen", "tls://0.0.0.0:4170", ["0.0.0.0"], tls=True, tokens=True)
    check_remote_bind("--http-listen", "https://[::]:443", ["::"], tls=True, tokens=True)


@pytest.mark.parametrize(
    ("flag", "tls", "tokens", "missing"),
    [
        ("--listen", False, False, "lacks TLS (the tls:// scheme with --tls-cert FILE and --tls-key FILE) and tokens (--auth-tokens FILE)"),
        ("--listen", True, False, "lacks tokens (--auth-tokens FILE)"),
        ("--listen", False, True, "lacks TLS (the tls:// scheme"),
        ("--http-listen", False, True, "lacks TLS (the https:// scheme"),
        ("--metrics-listen", False, False, "lacks TLS (the https:// scheme"),
    ],
)
def test_remote_without_both_is_refused_naming_the_flag_and_what_is_missing(
    flag: str, tls: bool, tokens: bool, missing: str
) -> None:
    with pytest.raises(RemoteBindError) as info:
        check_remote_bind(flag, "tcp://0.0.0.0:4170", ["127.0.0.1", "0.0.0.0"], tls=tls, tokens=tokens)
    text = str(info.value)
    assert text.startswith(f"{flag} tcp://0.0.0.0:4170: 0.0.0.0 is not a loopback address")
    assert missing in text


def test_non_loopback() -> None:
    assert non_loopback(["127.0.0.1", "10.0.0.1", "::1", "fe80::1%eth0", "::"]) == ["10.0.0.1", "fe80::1", "::"]
