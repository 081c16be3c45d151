"""``GET /openapi.json`` and ``schemas/http/``: generated from the handlers' msgspec types and the error
registry, committed byte for byte (``make schemas``), valid, and true of what a live server sends."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import httpx
import jsonschema
import pytest
import referencing
import referencing.jsonschema
import trio

from acp_server.errors import REGISTRY
from acp_server.schemagen import write
from acp_server.transports.http import rest_types
from acp_server.transports.http.openapi import LISTENER_KINDS, ROUTES, error_body_schema, files, generate
from acp_server.transports.http.rest import status_of

from .http_helpers import TIMEOUT_S, assert_http_error_valid, http_server

HTTP = pathlib.Path(__file__).resolve().parent.parent / "schemas" / "http"
OK = [{"type": "text", "text": "x"}]


def test_committed_http_schemas_are_what_make_schemas_writes(tmp_path: pathlib.Path) -> None:
    """``schemas/http/`` is exactly what ``python -m acp_server.schemagen`` writes (no file more or less)."""
    write(tmp_path)
    fresh = {p.name: p.read_text() for p in (tmp_path / "http").glob("*.json")}
    committed = {p.name: p.read_text() for p in HTTP.glob("*.json")}
    assert sorted(fresh) == sorted(committed)
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"run `make schemas`: {stale} differ"
    assert set(files()) == {f"http/{name}" for name in committed}


def test_one_error_body_schema_per_kind_and_each_is_valid() -> None:
    """A schema per error kind, Draft 2020-12, ``code`` pinned to its kind, the payload's fields beside
    ``error`` (``errorKind`` is ``code``), nothing else allowed."""
    assert {p.stem for p in HTTP.glob("*.json")} == {*REGISTRY, "error", "openapi"}
    for kind, cls in REGISTRY.items():
        doc = json.loads((HTTP / f"{kind}.json").read_text())
        jsonschema.Draft202012Validator.check_schema(doc)
        assert doc["properties"]["code"] == {"const": kind} and doc["additionalProperties"] is False
        fields = set(msgspec_fields(cls.data_type))
        assert set(doc["properties"]) == {"error", "code", *fields}
    jsonschema.Draft202012Validator.check_schema(json.loads((HTTP / "error.json").read_text()))


def msgspec_fields(struct: Any) -> list[str]:
    import msgspec

    return [f.encode_name for f in msgspec.structs.fields(struct)]


@pytest.mark.parametrize("kind", sorted(REGISTRY))
def test_real_error_bodies_validate_and_altered_ones_do_not(kind: str) -> None:
    """The body :func:`~acp_server.transports.http.rules.error_body` makes of a real error of each kind
    validates; with another code, a field more, or no ``error``, it does not."""
    from acp_server.transports.http.rules import error_body

    from .test_schemas import sample_error

    body = json.loads(error_body(sample_error(kind)))
    assert_http_error_valid(body)
    schema = error_body_schema(kind)
    for bad in ({**body, "code": "parse_error" if kind != "parse_error" else "internal"}, {**body, "extra": 1},
                {k: v for k, v in body.items() if k != "error"}):
        assert not jsonschema.Draft202012Validator(schema).is_valid(bad)


def _doc_validator(doc: dict[str, Any], ref: str) -> jsonschema.Draft202012Validator:
    resource = referencing.Resource(contents=doc, specification=referencing.jsonschema.DRAFT202012)
    registry: referencing.Registry[Any] = referencing.Registry().with_resource("urn:openapi", resource)
    return jsonschema.Draft202012Validator({"$ref": "urn:openapi" + ref}, registry=registry)


def test_document_is_openapi_3_1_with_every_route_and_its_refusals() -> None:
    """Every route is an operation; each schema is valid Draft 2020-12 and every ``$ref`` resolves;
    each operation lists the listener's refusals and its own, at the status :func:`status_of` sends."""
    doc = generate()
    assert doc["openapi"] == "3.1.0"
    assert {(r.path, r.method.lower()) for r in ROUTES} == {(p, m) for p, ops in doc["paths"].items() for m in ops}
    for name, schema in doc["components"]["schemas"].items():
        jsonschema.Draft202012Validator.check_schema(schema)
        _doc_validator(doc, f"#/components/schemas/{name}")  # builds
    text = json.dumps(doc)
    for ref in {part.split('"')[0] for part in text.split('"$ref": "')[1:]}:
        node: Any = doc
        for key in ref.removeprefix("#/").split("/"):
            node = node[key]
    for route in ROUTES:
        responses = doc["paths"][route.path][route.method.lower()]["responses"]
        for kind in {*route.kinds, *LISTENER_KINDS}:
            assert str(status_of(REGISTRY[kind])) in responses, (route.operation_id, kind)
    body = doc["components"]["schemas"]["PromptRequest"]
    assert body["required"] == ["prompt"] and "deadlineMs" in body["properties"]


async def _check(doc: dict[str, Any], method: str, template: str, r: httpx.Response) -> None:
    """``r`` has a status the operation documents and a body its schema for that status accepts."""
    responses = doc["paths"][template][method.lower()]["responses"]
    assert str(r.status_code) in responses, (method, template, r.status_code, r.text)
    content = responses[str(r.status_code)].get("content")
    if content is None:
        assert r.content == b""
        return
    [(media, spec)] = content.items()
    assert r.headers["content-type"].startswith(media)
    if media == "application/json":
        schema = spec["schema"]
        ref = schema.get("$ref")
        if ref is not None:
            _doc_validator(doc, ref).validate(r.json())
        else:
            refs = [s["$ref"] for s in schema.get("oneOf", [])]
            assert any(_doc_validator(doc, x).is_valid(r.json()) for x in refs) or jsonschema.Draft202012Validator(
                schema).is_valid(r.json()), r.text


async def test_served_document_and_live_answers_match_it() -> None:
    """``GET /openapi.json`` is :func:`generate`'s document; a walk through every route (successes and
    refusals) gets statuses and bodies the document has."""
    with trio.fail_after(TIMEOUT_S):
        async with http_server() as (_server, _n, url), httpx.AsyncClient(timeout=10) as c:
            served = await c.get(url + "/openapi.json")
            assert served.status_code == 200 and served.json() == json.loads(json.dumps(generate()))
            doc = served.json()
            walk: list[tuple[str, str, str, dict[str, Any]]] = [
                ("GET", "/health", "/health", {}), ("GET", "/health?deep=1", "/health", {}),
                ("GET", "/capabilities", "/capabilities", {}), ("GET", "/openapi.json", "/openapi.json", {}),
                ("POST", "/session", "/session", {"json": {"cwd": "/tmp"}}),
                ("POST", "/session", "/session", {"json": {"cwd": "relative"}}),
                ("POST", "/session", "/session", {"content": b"null", "headers": {"content-type": "application/json"}}),
            ]
            for method, path, template, kw in walk:
                await _check(doc, method, template, await c.request(method, url + path, **kw))
            sid = (await c.post(url + "/session", json={"cwd": "/tmp"})).json()["sessionId"]
            session = [
                ("POST", "load", {"json": {}}), ("POST", "resume", {}), ("POST", "heartbeat", {}),
                ("POST", "prompt", {"json": {"prompt": OK}}), ("POST", "prompt", {"json": {"prompt": []}}),
                ("POST", "prompt", {"json": {"prompt": OK}, "headers": {"X-Qwen-Client-Id": "nobody"}}),
                ("POST", "cancel", {}), ("POST", "detach", {}), ("GET", "events", {"params": {"maxQueued": "1"}}),
            ]
            for method, action, kw in session:
                r = await c.request(method, f"{url}/session/{sid}/{action}", **kw)
                await _check(doc, method, f"/session/{{sessionId}}/{action}", r)
                await _check(doc, method, f"/session/{{sessionId}}/{action}", await c.request(method, f"{url}/session/nope/{action}", **kw))
            vote = await c.post(f"{url}/session/{sid}/permission/perm_x", json={"optionId": "a"})
            await _check(doc, "POST", "/session/{sessionId}/permission/{requestId}", vote)
            listed = await c.get(url + "/workspace/%2Ftmp/sessions")
            await _check(doc, "GET", "/workspace/{cwd}/sessions", listed)
            await _check(doc, "DELETE", "/session/{sessionId}", await c.delete(f"{url}/session/{sid}"))
            gone = await c.post(url + "/sessions/delete", json={"sessionIds": [sid, "nope"]})
            await _check(doc, "POST", "/sessions/delete", gone)
            assert rest_types.DeleteSessionsResult.__name__ in json.dumps(doc)
