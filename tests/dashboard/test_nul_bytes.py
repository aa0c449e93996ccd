"""Issue 44, finding 7: a NUL byte in any text input is refused (4xx) at the boundary, the
same on SQLite and PostgreSQL (whose text cannot hold one: it was a 500 DataError for any
reader, and a run_start lost)."""

from __future__ import annotations

import json
import re
from typing import Any, get_args

import pytest
from dashboard_helpers import JSON_HEADERS, LOCAL
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from nanotron_dashboard.app import Settings, create_app
from nanotron_dashboard.messages import AnyMessage

# run_end's error is free text (a traceback may hold a NUL): stored with U+FFFD instead
# (test_backends.test_a_nul_in_a_run_end_error_is_stored_on_both)
NUL_KEPT_AS_FFFD = {("RunEnd", "error")}


@pytest.fixture
def c(db_url):
    app = create_app(Settings(db=db_url))
    with TestClient(app, base_url=LOCAL, headers=JSON_HEADERS) as client:
        r = client.post("/api/ingest", json={"type": "run_start", "run_id": "r"})
        assert r.status_code == 200, r.text
        yield client


QUERIES = [
    "/api/runs?name=%00",
    "/api/runs?project=a%00",
    "/api/runs?tag=%00",
    "/api/runs?ids=r,%00",
    "/api/runs?cursor=1.0_%00",
    "/api/runs/r/metrics?names=lm_loss,%00",
    "/api/runs/r/metrics.csv?names=%00",
    "/api/runs/r/rank_stats?fields=%00",
    "/api/runs/r/events?kind=%00",
    "/api/diff?a=r&b=%00",
]


@pytest.mark.parametrize("url", QUERIES)
def test_a_nul_in_a_query_parameter_is_a_400_on_both(c, url):
    r = c.get(url)
    assert r.status_code == 400 and "NUL" in r.json()["detail"], r.text
    assert c.get("/api/runs?name=r").status_code == 200  # and the server serves on


def test_a_nul_in_a_path_names_nothing_and_a_run_start_with_one_is_refused(c):
    for path in ("/api/runs/r%00", "/api/runs/r%00/metrics", "/static/a%00b", "/runs/r%00"):
        assert c.get(path).status_code == 404, path
    with pytest.raises(WebSocketDisconnect), c.websocket_connect("/ws/runs/r%00") as ws:
        ws.receive_text()
    start = {"type": "run_start", "run_id": "a", "attempt": "x\x00y"}
    r = c.post("/api/ingest", content=json.dumps(start))
    assert r.status_code == 422 and "attempt" in r.json()["errors"][0]["error"], r.text
    r = c.post("/api/ingest", content=json.dumps({**start, "attempt": "xy"}))
    assert r.status_code == 200 and r.json()["results"][0]["run_id"] == "a"


def _strings(schema: Any, where: str, defs: dict) -> list[tuple[str, dict]]:
    """Every string schema in a JSON schema (following $ref), with where it is."""
    if isinstance(schema, list):
        return [s for i, x in enumerate(schema) for s in _strings(x, f"{where}[{i}]", defs)]
    if not isinstance(schema, dict):
        return []
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return _strings(defs[name], name, {**defs, name: {}})  # each definition once
    out = [(where, schema)] if schema.get("type") == "string" else []
    for key, value in schema.items():
        if key in ("properties", "$defs"):
            out += [s for k, v in value.items() for s in _strings(v, f"{where}.{k}", defs)]
        elif key in ("items", "anyOf", "propertyNames", "additionalProperties", "prefixItems"):
            out += _strings(value, f"{where}.{key}", defs)
    return out


def test_every_text_field_of_every_message_refuses_a_nul():
    """One rule for every message, checked on the schema itself: a new text field without it
    fails here. (Free-form JSON - config, topology, details - is stored as JSON text, where a
    NUL is the escape \\u0000.)"""
    for model in get_args(AnyMessage):
        schema = model.model_json_schema()
        for where, s in _strings(schema, model.__name__, schema.get("$defs", {})):
            if "const" in s or "enum" in s:
                continue
            field = where.split(".")[1] if "." in where else where
            if (model.__name__, field) in NUL_KEPT_AS_FFFD:
                continue
            pattern = s.get("pattern")
            assert pattern and not re.search(pattern, "a\x00b"), (where, s)
