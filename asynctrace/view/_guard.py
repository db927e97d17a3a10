"""Which requests the viewer answers, and the headers every answer carries.

The page has no login and shows whatever the archive holds, so a web page the user happens to
visit must not read it: a DNS-rebinding page reaches 127.0.0.1 under a name of its own, which
its `Host` header gives away, so only the loopback names (and the address `--host` names) are
answered. Model output in the archive is attacker-controlled text: beyond escaping it (`_html`),
the Content-Security-Policy lets no script, inline style or outside resource run at all.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["CSP", "Guard", "host_names"]

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]
_OURS = {name for name, _ in _HEADERS}
LOOPBACK = ("127.0.0.1", "localhost", "[::1]")


def host_names(host: str) -> set[str]:
    """The names a request may give in `Host` for a server listening on `host`: the loopback
    names and `host` itself (an IPv6 address in brackets, as a `Host` header writes it)."""
    name = host.strip().lower()
    if ":" in name and not name.startswith("["):
        name = f"[{name}]"
    return {*LOOPBACK, name}


def _split(host: str) -> tuple[str, int | None] | None:
    """(name, port) of a `Host` header value; None when it is malformed."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        if end < 0:
            return None
        name, rest = host[: end + 1], host[end + 1 :]
    else:
        cut = host.find(":")
        name, rest = (host, "") if cut < 0 else (host[:cut], host[cut:])
    if not rest:
        return name, None
    if not rest.startswith(":") or not rest[1:].isdigit() or len(rest) > 6:
        return None
    return name, int(rest[1:])


class Guard:
    """ASGI middleware: refuses a request whose `Host` is missing or malformed (400) or names
    another server (421), and adds the security headers to every answer. With `port`, the
    `Host` must name that port too."""

    def __init__(self, app: ASGIApp, *, names: Iterable[str] = LOOPBACK, port: int | None = None) -> None:
        self.app = app
        self.names = frozenset(names)
        self.port = port

    def _refusal(self, scope: Scope) -> tuple[int, str] | None:
        given = [v for k, v in scope.get("headers", []) if k.lower() == b"host"]
        if len(given) != 1:
            return 400, "a request needs one Host header"
        parsed = _split(given[0].decode("latin-1"))
        if parsed is None:
            return 400, "malformed Host header"
        name, port = parsed
        # A Host without a port means port 80; with no port given here, any port will do.
        wrong_port = self.port is not None and port != self.port and not (port is None and self.port == 80)
        if name not in self.names or wrong_port:
            return 421, "this server answers only to its own address (127.0.0.1, localhost or [::1])"
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = self._refusal(scope)
        if refused is not None:
            status, reason = refused
            body = reason.encode() + b"\n"
            headers = [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
            ]
            await send({"type": "http.response.start", "status": status, "headers": headers + _HEADERS})
            await send({"type": "http.response.body", "body": body})
            return

        async def secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in _OURS]
                message = {**message, "headers": kept + _HEADERS}
            await send(message)

        await self.app(scope, receive, secured)
