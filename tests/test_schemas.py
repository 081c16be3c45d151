"""The error contract: the error classes, ``schemas/errors/codes.json``, the per-kind JSON Schemas and
the README agree; the committed schemas are what ``python -m acp_server.schemagen`` generates; every
schema is valid Draft 2020-12 and tells a real error from a wrong one; ``capabilities.json`` describes
what ``_acp_server/capabilities`` really answers."""

from __future__ import annotations

import copy
import inspect
import json
import pathlib
import re
import string
import subprocess
import sys
from typing import Any

import jsonschema
import msgspec
import msgspec.inspect as mi
import pytest

from acp_server import errors
from acp_server.admission import Limits
from acp_server.errors import REGISTRY, AcpError, InternalError, OverloadError, RemoteProtocolError
from acp_server.schemagen import DRAFT, generate

from .helpers import ROOT, SCHEMAS, connect, error_validator, running_server

#: The codes the issue and the README fix for each kind (a test, not a copy of the code: codes must be
#: tested, not trusted).
EXPECTED_CODES = {
    "parse_error": -32700,
    "invalid_request": -32600,
    "not_initialized": -32600,
    "message_too_large": -32600,
    "method_not_found": -32601,
    "invalid_params": -32602,
    "internal": -32603,
    "request_cancelled": -32800,
    "auth_required": -32000,
    "prompt_queue_full": -32001,
    "session_not_found": -32002,
    "invalid_client_id": -32003,
    "prompt_deadline_exceeded": -32004,
    "capacity_exceeded": -32005,
    "branch_while_prompt_active": -32006,
    "backend_unavailable": -32007,
    "idempotency_key_conflict": -32008,
    "session_limit_exceeded": -32009,
    "admission_deferred": -32010,
    "capacity_unavailable": -32011,
    "agent_error": -32012,
    "rate_limited": -32014,
    "lease_lost": -32015,
    "duplicate_in_flight": -32016,
    # HTTP-only refusals of /acp (bodies of non-2xx answers, never JSON-RPC errors)
    "route_not_found": -32600,
    "method_not_allowed": -32600,
    "forbidden_host": -32600,
    "forbidden_origin": -32600,
    "unsupported_media_type": -32600,
    "not_acceptable": -32600,
    "missing_header": -32600,
    "unknown_connection": -32600,
    "session_not_established": -32600,
    "batch_not_supported": -32600,
    "subscriber_limit_exceeded": -32017,
    "too_many_connections": -32011,
    "unauthorized": -32600,
    "insufficient_scope": -32600,
    "connection_evicted": -32600,
}

KINDS = sorted(REGISTRY)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def _placeholders(template: str) -> set[str]:
    return {field for _, field, _, _ in string.Formatter().parse(template) if field}


def _codes() -> dict[str, dict[str, Any]]:
    entries = json.loads((SCHEMAS / "errors" / "codes.json").read_text())["errors"]
    return {e["errorKind"]: e for e in entries}


def _schema(kind: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((SCHEMAS / "errors" / f"{kind}.json").read_text())
    return doc


def _sample(t: mi.Type) -> Any:
    """A valid value of a msgspec type (the first choice of unions and literals)."""
    if isinstance(t, mi.StrType):
        return "sess_0123456789abcdef"
    if isinstance(t, mi.BoolType):
        return True
    if isinstance(t, mi.IntType):
        return 7
    if isinstance(t, mi.FloatType):
        return 1.5
    if isinstance(t, mi.LiteralType):
        return t.values[0]
    if isinstance(t, mi.UnionType):
        return _sample(next(x for x in t.types if not isinstance(x, mi.NoneType)))
    if isinstance(t, mi.NoneType):
        return None
    if isinstance(t, mi.ListType):
        return [_sample(t.item_type)]
    if isinstance(t, mi.DictType):
        return {}
    if isinstance(t, mi.AnyType):
        return {"anything": [1, "two"]}
    raise AssertionError(f"no sample for {t!r}")


def _fields(kind: str) -> tuple[mi.Field, ...]:
    info = mi.type_info(REGISTRY[kind].data_type)
    assert isinstance(info, mi.StructType)
    return info.fields


def sample_error(kind: str) -> AcpError:
    """An instance of the error class of ``kind`` with a sample value in every field."""
    return REGISTRY[kind](**{f.name: _sample(f.type) for f in _fields(kind)})


# --- generated, committed ---------------------------------------------------------------------------


def test_committed_schemas_are_what_schemagen_generates(tmp_path: pathlib.Path) -> None:
    """``python -m acp_server.schemagen DIR`` reproduces ``schemas/`` byte for byte, with no file
    missing or extra (run ``make schemas`` after changing an error type)."""
    subprocess.run(
        [sys.executable, "-m", "acp_server.schemagen", str(tmp_path)], check=True, capture_output=True, cwd=ROOT
    )
    generated = {p.relative_to(tmp_path).as_posix(): p.read_bytes() for p in tmp_path.rglob("*.json")}
    committed = {p.relative_to(SCHEMAS).as_posix(): p.read_bytes() for p in SCHEMAS.rglob("*.json")}
    assert sorted(committed) == sorted(generated)
    stale = [name for name in generated if committed[name] != generated[name]]
    assert not stale, f"schemas/ is out of date for {stale}: run `make schemas`"


def test_generate_matches_the_committed_documents() -> None:
    """``generate()`` (what the command writes) equals the committed documents, parsed."""
    docs = generate()
    assert {rel: json.loads((SCHEMAS / rel).read_text()) for rel in docs} == docs


# --- classes, registry, codes.json, per-kind schemas, README ----------------------------------------


def test_every_error_class_is_registered_and_exported() -> None:
    """Each concrete error class (one with an ``errorKind``) is in REGISTRY and exported; kinds and
    class names are unique."""
    concrete = {
        obj
        for obj in vars(errors).values()
        if inspect.isclass(obj) and issubclass(obj, AcpError) and "kind" in vars(obj)
    }
    assert concrete == set(REGISTRY.values())
    assert {cls.__name__ for cls in concrete} <= set(errors.__all__)
    assert len({cls.__name__ for cls in concrete}) == len(concrete)
    for kind, cls in REGISTRY.items():
        assert cls.kind == kind
        assert cls.data_type.__struct_config__.tag == kind, f"{cls.__name__}'s payload is tagged differently"


def test_codes_are_the_documented_ones() -> None:
    """Every kind has the code the issue gives it; -32603 is for bugs alone, overload is retryable."""
    assert {kind: cls.code for kind, cls in REGISTRY.items()} == EXPECTED_CODES
    assert [k for k, c in EXPECTED_CODES.items() if c == -32603] == ["internal"]
    for kind, cls in REGISTRY.items():
        if issubclass(cls, OverloadError):
            assert cls.retryable and cls.code != InternalError.code, kind
        if issubclass(cls, RemoteProtocolError):
            assert -32700 <= cls.code <= -32600 and not cls.retryable, kind


def test_readme_error_table_agrees() -> None:
    """The README's error table lists every kind with its code, and nothing else."""
    readme = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| (-\d+) \|", readme, re.M))
    assert {kind: int(code) for kind, code in rows.items()} == {k: c.code for k, c in REGISTRY.items()}


def test_codes_json_agrees_with_the_classes() -> None:
    """codes.json has one entry per kind, with the class's code, name, retry policy, schema file,
    data fields and message template (placeholders being data fields)."""
    codes = _codes()
    assert sorted(codes) == KINDS
    for kind, cls in REGISTRY.items():
        entry = codes[kind]
        fields = ["errorKind", *(_camel(f) for f in cls.data_type.__struct_fields__)]
        assert entry["code"] == cls.code, kind
        assert entry["class"] == cls.__name__, kind
        assert entry["retryable"] is cls.retryable, kind
        assert entry["dataFields"] == fields, kind
        assert (SCHEMAS / "errors" / entry["dataSchema"]).is_file(), kind
        assert _placeholders(entry["messageTemplate"]) <= set(fields), kind
        assert entry["messageTemplate"] == re.sub(r"\{(\w+)\}", lambda m: "{" + _camel(m.group(1)) + "}", cls.template)


@pytest.mark.parametrize("kind", KINDS)
def test_payload_schema_matches_the_struct(kind: str) -> None:
    """The kind's schema has exactly the Struct's fields, requires those without a default, pins
    ``errorKind`` and allows nothing else."""
    cls = REGISTRY[kind]
    fields = _fields(kind)
    schema = _schema(kind)
    assert schema["$schema"] == DRAFT
    assert schema["$id"].endswith(f"/errors/{kind}.json")
    assert str(cls.code) in schema["title"]
    assert schema["type"] == "object"
    assert schema["additionalProperties"] is False
    assert schema["properties"]["errorKind"] == {"enum": [kind]}
    assert set(schema["properties"]) == {"errorKind", *(f.encode_name for f in fields)}
    assert schema["required"] == ["errorKind", *(f.encode_name for f in fields if f.required)]


@pytest.mark.parametrize("kind", KINDS)
def test_message_template_uses_only_data_fields(kind: str) -> None:
    """Each message template formats from the payload's fields alone, leaving no placeholder."""
    cls = REGISTRY[kind]
    assert _placeholders(cls.template) <= set(cls.data_type.__struct_fields__)
    error = sample_error(kind)
    assert error.message and "{" not in str(error.message)


# --- the schemas as validators ----------------------------------------------------------------------


def test_every_schema_is_valid_draft_2020_12() -> None:
    """Every schema file is a valid Draft 2020-12 schema; codes.json is data, not a schema (``http/``,
    the HTTP bodies and the OpenAPI document, is tests/test_http_openapi.py's)."""
    files = sorted(p for p in SCHEMAS.rglob("*.json") if p.parent.name != "http")
    assert len(files) == len(REGISTRY) + 4  # codes, jsonrpc-error, capabilities, evicted
    for path in files:
        doc = json.loads(path.read_text())
        if path.name == "codes.json":
            assert "$schema" not in doc
            continue
        assert doc["$schema"] == DRAFT, path
        jsonschema.Draft202012Validator.check_schema(doc)


def _invalid(error: dict[str, Any]) -> bool:
    return not error_validator().is_valid(error)


@pytest.mark.parametrize("kind", KINDS)
def test_error_instance_validates_and_wrong_ones_do_not(kind: str) -> None:
    """A real error of each kind validates against jsonrpc-error.json; a wrong code, a wrong or
    missing ``errorKind``, an extra or missing data field, or an empty message do not."""
    cls = REGISTRY[kind]
    good = json.loads(msgspec.json.encode(sample_error(kind).to_dict()))
    assert good["code"] == cls.code and good["data"]["errorKind"] == kind
    error_validator().validate(good)

    def broken(change: Any) -> dict[str, Any]:
        bad = copy.deepcopy(good)
        change(bad)
        return bad

    other_code = next(c for c in sorted(set(EXPECTED_CODES.values())) if c != cls.code)
    other_kind = next(k for k in KINDS if REGISTRY[k].code != cls.code)
    assert _invalid(broken(lambda e: e.update(code=other_code)))
    assert _invalid(broken(lambda e: e["data"].update(errorKind=other_kind)))
    assert _invalid(broken(lambda e: e["data"].pop("errorKind")))
    assert _invalid(broken(lambda e: e["data"].update(unexpectedField=1)))
    assert _invalid(broken(lambda e: e.update(message="")))
    assert _invalid(broken(lambda e: e.update(extra=True)))
    assert _invalid(broken(lambda e: e.pop("data")))
    for field in _schema(kind)["required"]:
        if field != "errorKind":
            assert _invalid(broken(lambda e, f=field: e["data"].pop(f))), field


def _capabilities_validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json.loads((SCHEMAS / "capabilities.json").read_text()))


@pytest.mark.parametrize(
    "limits",
    [Limits(), Limits(max_pending_prompts_per_session=0, prompt_deadline_ms=5000, max_outbound_bytes=4096)],
    ids=["defaults", "custom"],
)
async def test_capabilities_schema_validates_the_real_result(limits: Limits) -> None:
    """``_acp_server/capabilities`` and ``initialize``'s ``_meta.limits`` validate against
    capabilities.json, which is strict enough to reject a mistyped limit."""
    validator = _capabilities_validator()
    limits_validator = jsonschema.Draft202012Validator(
        {"$ref": "#/$defs/LimitsCapability", "$defs": validator.schema["$defs"]}
    )
    async with running_server(limits) as (server, nursery):
        client = await connect(server, nursery, initialize=False)
        init = await client.initialize()
        caps = await client.call("_acp_server/capabilities")
    validator.validate(caps)
    limits_validator.validate(init["agentCapabilities"]["_meta"]["limits"])
    assert init["agentCapabilities"]["_meta"]["limits"] == caps["limits"]
    assert caps["limits"]["maxPendingPromptsPerSession"] == (limits.max_pending_prompts_per_session or None)
    assert caps["limits"]["promptDeadlineMs"] == (limits.prompt_deadline_ms or None)

    wrong = copy.deepcopy(caps)
    wrong["limits"]["maxPendingPromptsPerSession"] = "5"
    assert not validator.is_valid(wrong)
    missing = copy.deepcopy(caps)
    del missing["limits"]["maxMessageBytes"]
    assert not validator.is_valid(missing)
