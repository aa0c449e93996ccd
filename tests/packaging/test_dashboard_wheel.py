"""The dashboard's wheel alone, in a fresh venv without torch: it starts and serves its pages
and every asset those pages reference, byte for byte as shipped in the wheel."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
import zipfile
from html.parser import HTMLParser

import pytest

from tests.packaging.packaging_helpers import ROOT

VERSION = (ROOT / "VERSION").read_text().strip()


class AssetRefs(HTMLParser):
    """The local URLs a page loads: <script src>, <link href>, <img src>."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("src", "href") and value and value.startswith("/static/"):
                self.refs.append(value)


def page_assets(html: str) -> list[str]:
    parser = AssetRefs()
    parser.feed(html)
    return parser.refs


def css_assets(css: str) -> list[str]:
    return [u for u in re.findall(r"url\(['\"]?([^'\")]+)", css) if u.startswith("/static/")]


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_dashboard_venv_has_no_torch_and_nothing_else_of_ours(dashboard_venv, tmp_path):
    out = dashboard_venv.run(
        "import importlib.util as u, json, nanotron_dashboard as d;"
        "print(json.dumps([d.__version__, d.__file__, [m for m in ('torch', 'nanotron_train',"
        " 'nanotron_models', 'nanotron_parallel') if u.find_spec(m)]]))",
        cwd=tmp_path,
    )
    version, module_file, present = json.loads(out)
    assert version == VERSION
    assert module_file.startswith(str(dashboard_venv.root))  # the wheel's copy, not the tree's
    assert present == []


@pytest.mark.slow
def test_dashboard_wheel_alone_serves_its_pages_and_every_asset_they_reference(
    dashboard_venv, built, tmp_path
):
    with zipfile.ZipFile(built["dashboard"].wheel) as z:
        shipped = {
            n.removeprefix("nanotron_dashboard"): z.read(n)
            for n in z.namelist()
            if n.startswith("nanotron_dashboard/static/")
        }
    port = free_port()
    proc = subprocess.Popen(
        [str(dashboard_venv.bin("nanotron-dashboard")), "--db", str(tmp_path / "runs.db"),
         "--port", str(port)],
        cwd=tmp_path, env=dashboard_venv.env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, body = get(base + "/api/runs")
                break
            except OSError:
                assert proc.poll() is None, f"the dashboard exited:\n{proc.stdout.read()}"
                assert time.monotonic() < deadline, "the dashboard did not start within 60 s"
                time.sleep(0.2)
        assert status == 200 and json.loads(body) == [], body[:300]

        served: dict[str, bytes] = {}
        for page in ("/", "/runs/some-run"):
            status, html = get(base + page)
            assert status == 200, page
            refs = page_assets(html.decode())
            assert refs, f"{page} references no asset: the parser or the page changed"
            for ref in refs:
                status, body = get(base + ref)
                assert status == 200, f"{page} references {ref}: HTTP {status}"
                served[ref] = body
                if ref.endswith(".css"):
                    for nested in css_assets(body.decode()):
                        status, served[nested] = get(base + nested)
                        assert status == 200, f"{ref} references {nested}: HTTP {status}"
        assert {"/static/vendor/uPlot.iife.min.js", "/static/vendor/uPlot.min.css"} <= served.keys()
        for ref, body in served.items():
            assert body == shipped[ref], f"{ref} differs from the wheel's file"
    finally:
        proc.terminate()
        proc.wait(15)
