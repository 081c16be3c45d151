"""The tokens file: parsing with precise errors, the privacy check, the constant-time store, reload."""

from __future__ import annotations

import hashlib
import os
import pathlib
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from acp_server.auth import tokens as tokens_mod
from acp_server.auth.tokens import (
    OWNER,
    TokenFileError,
    TokenPermissionError,
    TokenRecord,
    TokenStore,
    hash_secret,
    load_tokens,
    new_secret,
    parse_tokens,
    render_tokens,
    write_tokens,
)

SECRET_A = "secret-of-acme-0000000000000000000000000000"
SECRET_B = "secret-of-beta-1111111111111111111111111111"
NOW = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)


def _file(tmp_path: pathlib.Path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / "tokens.toml"
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


GOOD = f"""
[tokens.acme-ci]
sha256 = "{hash_secret(SECRET_A)}"
tenant = "acme"
scopes = ["metrics"]
expires = 2027-01-01T00:00:00Z

[tokens.beta]
sha256 = "{hash_secret(SECRET_B).upper()}"
tenant = "beta"
scopes = ["admin"]
expires = "2026-12-01T11:00:00+01:00"
"""


def test_parse_reads_every_field() -> None:
    records = parse_tokens(GOOD)
    a, b = records["acme-ci"], records["beta"]
    assert a.tenant == "acme" and a.scopes == {"metrics"} and a.sha256 == hashlib.sha256(SECRET_A.encode()).digest()
    assert a.expires == datetime(2027, 1, 1, tzinfo=UTC)
    assert b.scopes == {"admin"} and b.expires == datetime(2026, 12, 1, 10, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[tokens.a\n", "not valid TOML"),
        ('extra = 1\n', "extra: unknown key"),
        ("tokens = 3\n", "tokens: must be a table"),
        ('[tokens.a]\ntenant = "t"\n', "tokens.a.sha256: required, 64 hex digits"),
        ('[tokens.a]\nsha256 = "abc"\ntenant = "t"\n', "tokens.a.sha256: required, 64 hex digits"),
        (f'[tokens.a]\nsha256 = "{"0" * 64}"\n', "tokens.a.tenant: required"),
        (f'[tokens.a]\nsha256 = "{"0" * 64}"\ntenant = ""\n', "tokens.a.tenant: required"),
        (f'[tokens.a]\nsha256 = "{"0" * 64}"\ntenant = "t"\nscopes = ["root"]\n', "tokens.a.scopes: a list of"),
        (f'[tokens.a]\nsha256 = "{"0" * 64}"\ntenant = "t"\nsecret = "x"\n', "tokens.a.secret: unknown key"),
        (f'[tokens.a]\nsha256 = "{"0" * 64}"\ntenant = "t"\nexpires = 2027-01-01T00:00:00\n', "needs a UTC offset"),
        (f'[tokens.a]\nsha256 = "{"0" * 64}"\ntenant = "t"\nexpires = "soon"\n', "tokens.a.expires: must be an RFC 3339"),
        (f'[tokens.a]\nsha256 = "{"0" * 64}"\ntenant = "t"\nexpires = 2027-01-01\n', "tokens.a.expires: must be an RFC 3339"),
        (f'[tokens."a b"]\nsha256 = "{"0" * 64}"\ntenant = "t"\n', "a token id is 1-64 letters"),
        (f'[tokens.a]\nsha256 = "{"0" * 64}"\ntenant = "t"\n[tokens.b]\nsha256 = "{"0" * 64}"\ntenant = "u"\n',
         "tokens.b.sha256: the same secret as tokens.a"),
    ],
)
def test_parse_errors_name_the_key(text: str, expected: str) -> None:
    with pytest.raises(TokenFileError) as info:
        parse_tokens(text, "FILE")
    assert str(info.value).startswith("FILE: ")
    assert expected in str(info.value)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o660])
def test_a_file_others_can_access_is_refused_with_the_fix(tmp_path: pathlib.Path, mode: int) -> None:
    path = _file(tmp_path, GOOD, mode)
    with pytest.raises(TokenPermissionError) as info:
        load_tokens(path)
    assert path in str(info.value) and f"chmod 600 {path}" in str(info.value)
    assert f"{mode:04o}" in str(info.value)


def test_a_private_file_loads(tmp_path: pathlib.Path) -> None:
    assert sorted(load_tokens(_file(tmp_path, GOOD, 0o600))) == ["acme-ci", "beta"]
    assert sorted(load_tokens(_file(tmp_path, GOOD, 0o400))) == ["acme-ci", "beta"]


def test_a_symlink_or_a_missing_file_is_refused(tmp_path: pathlib.Path) -> None:
    target = _file(tmp_path, GOOD)
    link = tmp_path / "link.toml"
    link.symlink_to(target)
    with pytest.raises(TokenFileError, match="cannot open the tokens file"):
        load_tokens(str(link))
    with pytest.raises(TokenFileError, match="cannot open the tokens file: No such file"):
        load_tokens(str(tmp_path / "absent.toml"))


def _store(clock: datetime = NOW) -> TokenStore:
    return TokenStore(parse_tokens(GOOD), clock=lambda: clock)


def test_the_store_grants_the_token_identity() -> None:
    store = _store()
    a = store.authenticate(SECRET_A)
    assert a is not None and (a.token_id, a.tenant, a.scopes) == ("acme-ci", "acme", {"metrics"})
    assert a.may_scrape and not a.admin and a.may_act_for("acme") and not a.may_act_for("beta")
    b = _store(datetime(2026, 12, 1, 9, 0, tzinfo=UTC)).authenticate(SECRET_B)
    assert b is not None and b.admin and b.may_act_for("anyone")


@pytest.mark.parametrize("bad", [None, 42, b"bytes", "", "wrong", SECRET_A + " ", SECRET_A[:-1], "x" * 10_000])
def test_the_store_refuses_anything_else(bad: object) -> None:
    assert _store().authenticate(bad) is None


def test_expired_tokens_are_refused() -> None:
    assert _store(datetime(2026, 12, 1, 9, 59, tzinfo=UTC)).authenticate(SECRET_B) is not None
    assert _store(NOW).authenticate(SECRET_B) is None  # expires at 10:00 UTC exactly
    assert _store(NOW).authenticate(SECRET_A) is not None
    assert _store(datetime(2027, 1, 1, tzinfo=UTC)).authenticate(SECRET_A) is None


def test_every_record_is_compared_whichever_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    records = {f"t{i}": TokenRecord(f"t{i}", hashlib.sha256(f"s{i}".encode()).digest(), "x") for i in range(20)}
    store = TokenStore(records)
    calls: list[int] = []
    real = tokens_mod.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(tokens_mod.hmac, "compare_digest", counting)
    for secret in ("s0", "s19", "s7", "nope"):
        calls.clear()
        store.authenticate(secret)
        assert len(calls) == 20, secret


def test_reload_takes_a_good_file_and_keeps_the_old_tokens_otherwise(tmp_path: pathlib.Path) -> None:
    path = _file(tmp_path, GOOD)
    store = TokenStore.from_file(path, clock=lambda: NOW)
    identity = store.authenticate(SECRET_A)
    assert identity is not None and store.valid(identity)
    # broken TOML: kept
    pathlib.Path(path).write_text("[tokens.a\n")
    result = store.reload()
    assert result.error is not None and "not valid TOML" in result.error
    assert store.authenticate(SECRET_A) is not None
    # bad permissions: kept, the error names the fix
    write_tokens(path, parse_tokens(GOOD).values())
    os.chmod(path, 0o644)
    result = store.reload()
    assert result.error is not None and f"chmod 600 {path}" in result.error
    assert store.authenticate(SECRET_A) is not None
    # acme-ci revoked, beta's tenant changed, gamma added
    records = parse_tokens(GOOD)
    beta = records["beta"]
    new = [
        TokenRecord("beta", beta.sha256, "beta2", beta.scopes, beta.expires),
        TokenRecord("gamma", bytes.fromhex(hash_secret("g")), "g"),
    ]
    write_tokens(path, new)
    result = store.reload()
    assert result.error is None
    assert (result.added, result.removed, result.changed) == (("gamma",), ("acme-ci",), ("beta",))
    assert store.authenticate(SECRET_A) is None and not store.valid(identity)
    assert store.valid(OWNER)
    assert store.ids() == ["beta", "gamma"] and len(store) == 2


def test_valid_turns_false_at_expiry() -> None:
    now = [datetime(2026, 12, 1, 9, 0, tzinfo=UTC)]
    store = TokenStore(parse_tokens(GOOD), clock=lambda: now[0])
    identity = store.authenticate(SECRET_B)
    assert identity is not None and store.valid(identity)
    now[0] = NOW
    assert not store.valid(identity)


def test_write_is_atomic_and_private(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "t.toml")
    write_tokens(path, parse_tokens(GOOD).values())
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.listdir(tmp_path) == ["t.toml"]  # no temporary file left behind
    assert load_tokens(path) == parse_tokens(GOOD)
    assert SECRET_A not in pathlib.Path(path).read_text()


def test_new_secrets_are_256_bits() -> None:
    secrets_ = {new_secret() for _ in range(50)}
    assert len(secrets_) == 50 and all(len(s) == 43 for s in secrets_)


_tenants = st.text(st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp")), min_size=1, max_size=40).filter(
    str.isprintable
)


@given(
    st.lists(
        st.tuples(
            st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True),
            st.binary(min_size=32, max_size=32),
            _tenants,
            st.frozensets(st.sampled_from(["admin", "metrics"])),
            st.none() | st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1)),
        ),
        max_size=5,
        unique_by=(lambda t: t[0], lambda t: t[1]),
    )
)
def test_render_and_parse_round_trip(rows: list[tuple[str, bytes, str, frozenset[str], datetime | None]]) -> None:
    records = [
        TokenRecord(i, d, t, s, None if e is None else e.replace(microsecond=0, tzinfo=UTC)) for i, d, t, s, e in rows
    ]
    assert parse_tokens(render_tokens(records)) == {r.id: r for r in records}


def test_expiry_in_the_future_is_not_expired() -> None:
    record = TokenRecord("x", b"\0" * 32, "t", expires=NOW + timedelta(seconds=1))
    assert not record.expired(NOW) and record.expired(NOW + timedelta(seconds=1))
