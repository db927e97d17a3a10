"""`asynctrace view` is safe to open on any archive: every value from the archive stays text in every
context, every answer carries a strict Content-Security-Policy, and only the server's own address
is answered (no DNS rebinding)."""

from __future__ import annotations

import http.client
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode, urlsplit

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from . import _archive, _hostile
from ._html import get
from ._tree import Node, parse

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
_FORBIDDEN_TAGS = {
    "script",
    "img",
    "iframe",
    "object",
    "embed",
    "base",
    "frame",
    "frameset",
    "style",
    "video",
    "audio",
}
# The only stylesheets and icon a page links: the server's own files.
_ASSETS = ("/static/view.css", "/static/tokens.css", "/static/favicon.svg")
_URL_ATTRIBUTES = ("href", "src", "action", "formaction", "xlink:href", "data", "poster")


@pytest.fixture(scope="module")
def hostile(hostile_archive: Path) -> Path:
    return hostile_archive


@pytest.fixture(scope="module")
def base(hostile: Path) -> Iterator[str]:
    with _archive.served(hostile, watch=_hostile.WATCH) as url:
        yield url


def inert(path: str, html: str) -> Node:
    """The page, checked to hold nothing a value could have made active: no script or other
    active element, no event handler or style attribute, no link but to this server."""
    root = parse(html)
    for node in root.walk():
        assert node.tag not in _FORBIDDEN_TAGS, (path, node.tag, node.attrs)
        for name, value in node.attrs.items():
            assert not name.startswith("on") and name != "style", (path, node.tag, name)
            if name in _URL_ATTRIBUTES:
                assert value.startswith(("/", "#")) and not value.startswith("//"), (path, name, value)
        if node.tag == "link":
            assert node.attrs.get("href") in _ASSETS, (path, node.attrs)
        if node.tag == "meta":
            assert set(node.attrs) <= {"charset", "name", "content", "http-equiv"}, (path, node.attrs)
            assert node.attrs.get("http-equiv", "refresh") == "refresh" and "url" not in node.attrs.get(
                "content", ""
            )
    return root


def _crawl(base: str, start: list[str], per_kind: int = 4) -> dict[str, str]:
    """The pages reachable from `start` by the links on the pages, up to `per_kind` of each path
    (/step, /group, ...): path → HTML."""
    seen: dict[str, str] = {}
    kinds: dict[str, int] = {}
    todo = list(start)
    while todo:
        path = todo.pop(0)
        kind = urlsplit(path).path
        if path in seen or kinds.get(kind, 0) >= per_kind:
            continue
        kinds[kind] = kinds.get(kind, 0) + 1
        page = get(base, path)
        assert page.status == 200, (path, page.status, page.html[-400:])
        seen[path] = page.html
        todo += [link for link in page.links if link.startswith("/") and link not in seen]
    return seen


def test_hostile_values_stay_text_on_every_page(base: str, hostile: Path) -> None:
    """Every page reachable from the overview (steps, groups, prompts, records, tokens, find) of an
    archive holding payloads in every field shows each field's value as text and nothing active."""
    record = "/record?" + urlencode({"id": f"{_hostile.payload('id')}0"})
    searches = [
        "/find?" + urlencode({"q": "hostile role"}),
        "/find?" + urlencode({"q": "x", "split": _hostile.SPLIT}),
    ]
    pages = _crawl(base, ["/", record, *searches])
    text = ""
    for path, html in pages.items():
        text += inert(path, html).text()
    assert {urlsplit(p).path for p in pages} >= {
        "/",
        "/step",
        "/group",
        "/prompt",
        "/record",
        "/tokens",
        "/find",
    }
    # Each payload was shown (as text) somewhere: every field reached a page.
    assert [f for f in _hostile.FIELDS if _hostile.marker(f) not in text] == []


def test_find_by_a_hostile_id_leads_within_the_server(base: str) -> None:
    """A record or prompt id full of markup found by id redirects to its page on this server; a
    group id at several steps lists them, each link to this server."""
    for name in (_hostile.PROMPT, f"{_hostile.payload('id')}3"):
        found = get(base, "/find?" + urlencode({"id": name}))
        assert found.status == 303 and found.location is not None and found.location.startswith("/")
        page = get(base, found.location)
        assert page.status == 200
        inert(found.location, page.html)
    listed = get(base, "/find?" + urlencode({"id": f"{_hostile.payload('group')}1"}))
    assert listed.status == 200
    groups = [
        link for link in inert("/find", listed.html).all("a") if link.attrs["href"].startswith("/group")
    ]
    assert len(groups) == 6  # three steps, two splits
    assert all(get(base, a.attrs["href"]).status == 200 for a in groups)


def test_prompt_history_writes_no_raw_id_into_an_attribute(base: str) -> None:
    """The step-to-step diffs name their records in escaped attributes (a raw id there ran script)."""
    page = get(base, "/prompt?" + urlencode({"id": _hostile.PROMPT, "split": "train"}))
    root = inert("/prompt", page.html)
    diffs = root.all("section", "diff")
    assert diffs and all(d.attrs["data-from"].startswith(_hostile.payload("id")) for d in diffs)


def _request(base: str, path: str, host: str | None) -> tuple[int, dict[str, str], str]:
    """GET `path` with this `Host` header (None: none at all, over HTTP/1.0)."""
    where = urlsplit(base)
    if host is None:
        with socket.create_connection((where.hostname, where.port), timeout=10) as sock:
            sock.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
            raw = b""
            while chunk := sock.recv(65536):
                raw += chunk
        head, _, body = raw.decode().partition("\r\n\r\n")
        lines = head.split("\r\n")
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        return int(lines[0].split()[1]), headers, body
    conn = http.client.HTTPConnection(where.hostname or "", where.port, timeout=10)
    try:
        conn.putrequest("GET", path, skip_host=True)
        conn.putheader("Host", host)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read().decode()
    finally:
        conn.close()


def test_only_the_servers_own_names_are_answered(base: str) -> None:
    """127.0.0.1, localhost and [::1] are answered; another name (a DNS-rebinding page) 421, a
    request without a Host or with a malformed one 400."""
    port = urlsplit(base).port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", f"[::1]:{port}"):
        assert _request(base, "/", host)[0] == 200, host
    for host in (
        f"evil.example:{port}",
        "evil.example",
        f"127.0.0.1.evil.example:{port}",
        f"localhost.:{port}",
    ):
        status, headers, body = _request(base, "/", host)
        assert status == 421 and "answers only to its own address" in body, host
        assert headers["content-security-policy"] == CSP
    for host in ("[::1", f"localhost:{port}x", f"localhost:{port}:1"):
        assert _request(base, "/", host)[0] == 400, host
    assert _request(base, "/", None)[0] == 400


def test_every_answer_carries_the_security_headers(base: str) -> None:
    """Pages, errors, redirects, static files and unknown paths: each has the strict CSP, nosniff
    and no referrer; the favicon is served (no 404 on a first visit)."""
    paths = {
        "/": 200,
        "/static/view.css": 200,
        "/static/favicon.svg": 200,
        "/favicon.ico": 200,
        "/step?step=x": 400,
        "/record?id=nope": 404,
        "/nope": 404,
        "/find?" + urlencode({"id": _hostile.PROMPT}): 303,
    }
    for path, status in paths.items():
        got, headers, _ = _request(base, path, f"127.0.0.1:{urlsplit(base).port}")
        assert got == status, path
        assert headers["content-security-policy"] == CSP, path
        assert headers["x-content-type-options"] == "nosniff", path
        assert headers["referrer-policy"] == "no-referrer", path
    assert (
        _request(base, "/favicon.ico", f"localhost:{urlsplit(base).port}")[1]["content-type"]
        == "image/svg+xml"
    )


def test_the_indexing_page_carries_them_too(hostile: Path) -> None:
    """While the archive is indexed (503) the answer has the same headers and reloads itself
    without script."""
    import threading

    from asynctrace.view import _app
    from asynctrace.view._archive import Archive

    release = threading.Event()

    class Slow(Archive):
        def load(self, keep: bool = True) -> None:
            assert release.wait(20)
            super().load(keep)

    store = Slow(hostile)
    with _archive.serving(_app.build_app(store, loading=_app.Loading(store))) as url:
        status, headers, body = _request(url, "/", f"127.0.0.1:{urlsplit(url).port}")
        release.set()
    assert status == 503 and headers["content-security-policy"] == CSP
    inert("/", body)


def test_an_embedded_app_answers_the_names_it_is_given(hostile: Path) -> None:
    """`make_app` answers the loopback names on any port and the `hosts` it names, no other."""
    from starlette.testclient import TestClient

    from asynctrace.view import make_app

    plain, named = make_app(hostile), make_app(hostile, hosts=["testserver", "viewer.internal"])
    assert TestClient(plain).get("/").status_code == 421
    assert TestClient(plain, base_url="http://localhost:1234").get("/").status_code == 200
    assert TestClient(named).get("/").status_code == 200
    assert TestClient(named, base_url="http://viewer.internal").get("/").status_code == 200
    assert TestClient(named, base_url="http://other.internal").get("/").status_code == 421
