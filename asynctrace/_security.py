"""Security helpers: credentials kept out of asynctrace's own output, and names kept out of paths.

Scrubbing keeps credentials out of everything asynctrace writes itself: errors, log lines, spool
files, the console.

A token can reach asynctrace's own output by several routes: an exception from a hub client that
quotes a URL with ``write_token=...``, an environment value echoed by a library, or a prompt
that happens to contain one. Everything asynctrace formats passes through `scrub` (text) or
`scrub_bytes` (spool lines) first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import unquote, urlsplit, urlunsplit

import orjson

__all__ = [
    "REDACTED",
    "ScrubFilter",
    "ScrubbedUrl",
    "TraceLogger",
    "check_name",
    "check_text",
    "describe",
    "generated_run_name",
    "logger",
    "scrub",
    "scrub_bytes",
    "secret_bytes",
    "scrub_url",
    "shown",
]

REDACTED = "***"

# Environment variables whose values are credentials: the well-known ones, and any name that
# ends like a credential (HF_TOKEN, TRACKIO_WRITE_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY...).
_KNOWN = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "TRACKIO_WRITE_TOKEN", "WANDB_API_KEY")
_SECRET_NAME = re.compile(r"(?:^|_)(?:TOKEN|API_KEY|SECRET|SECRET_KEY|ACCESS_KEY|PASSWORD)$")
# Shorter values are too likely to be ordinary words ("true", "1") to be worth replacing.
_MIN_SECRET_LEN = 8

_HF = (r"hf_[A-Za-z0-9]{16,}", "hf_" + REDACTED)
_WRITE_TOKEN = (r"(write_token=)[^&\s#'\"<>\\]+", r"\1" + REDACTED)
# A URL's query or fragment parameter whose value is a credential: these names, or any name
# ending in one after a separator (`write_token`, `X-Amz-Credential`, `private_key`, `sig`).
_PARAM_NAMES = (
    r"(?:[A-Za-z0-9]+[_.-])*"
    r"(?:token|key|apikey|secret|password|passwd|pwd|sig|signature|credentials?|auth|authorization)"
)
_CREDENTIAL_PARAM = re.compile(_PARAM_NAMES, re.IGNORECASE)
_SCHEME = r"[A-Za-z][A-Za-z0-9+.-]*://"
# Each with what the lowercased text must hold for it to match: a pattern that ignores case
# costs several microseconds even on a short text, and every RecordError is scrubbed.
_TEXT_PATTERNS = (
    (re.compile(_HF[0]), _HF[1], "hf_"),
    (re.compile(_WRITE_TOKEN[0], re.IGNORECASE), _WRITE_TOKEN[1], "write_token="),
    (
        re.compile(r"((?:access_token|api_key|token)=)[^&\s#'\"<>]+", re.IGNORECASE),
        r"\1" + REDACTED,
        "=",
    ),
    (re.compile(r"(Bearer\s+)[A-Za-z0-9._~+/=-]{8,}", re.IGNORECASE), r"\1" + REDACTED, "bearer"),
    # A URL's user part (`https://user:password@host`) and its credential parameters.
    (re.compile(rf"(\b{_SCHEME})[^\s/?#@'\"<>]+@"), r"\1" + REDACTED + "@", "://"),
    (re.compile(rf"([?&;#]{_PARAM_NAMES}=)[^&;#\s'\"<>]+", re.IGNORECASE), r"\1" + REDACTED, "="),
)
# Spooled samples are user data: only what is unmistakably a credential is replaced there
# (a Hugging Face token, a Trackio write token in a URL, a credential value from the environment).
_BYTES_PATTERNS = (
    (re.compile(_HF[0].encode()), _HF[1].encode(), None, (b"hf_",)),
    # The pattern ignores case; the checks look for "=" first (one memchr, where a substring
    # search costs about 2 us per 2.5 KB), then for "n=" in either case.
    (
        re.compile(_WRITE_TOKEN[0].encode(), re.IGNORECASE),
        _WRITE_TOKEN[1].encode(),
        b"=",
        (b"n=", b"N="),
    ),
)


def _read_secrets() -> list[str]:
    values = {
        value
        for name, value in os.environ.items()
        if (name in _KNOWN or _SECRET_NAME.search(name)) and len(value) >= _MIN_SECRET_LEN
    }
    return sorted(values, key=len, reverse=True)


# (the environment it was read from, its credential values, their text forms): reading the
# environment costs tens of microseconds, and every RecordError scrubs its text, so one
# reading serves until the environment changes. os.environ keeps its items in `_data`, a dict
# of bytes whose items compare in C; without it (another Python), every call reads afresh.
_cached: tuple[tuple[Any, ...], list[str], list[str]] | None = None


def _secrets() -> tuple[list[str], list[str]]:
    """The credential values in the environment and every text form of them, longest first."""
    global _cached
    data = getattr(os.environ, "_data", None)
    key = tuple(data.items()) if isinstance(data, dict) else None
    cached = _cached
    if key is not None and cached is not None and cached[0] == key:
        return cached[1], cached[2]
    values = _read_secrets()
    forms = sorted({form for value in values for form in _text_forms(value)}, key=len, reverse=True)
    if key is not None:
        _cached = (key, values, forms)
    return values, forms


def secret_bytes() -> list[bytes]:
    """The credential values in the environment as they appear in UTF-8 JSON: as is, and
    JSON-escaped where that differs (a value holding a quote, a backslash or a control
    character), longest first."""
    out: set[bytes] = set()
    for value in _secrets()[0]:
        try:
            out.add(value.encode())
            out.add(orjson.dumps(value)[1:-1])
        except (UnicodeEncodeError, orjson.JSONEncodeError):
            # Not valid UTF-8 (an environment value with undecodable bytes): it cannot
            # appear in UTF-8 JSON, so there is nothing to replace.
            continue
    return sorted(out, key=len, reverse=True)


def _text_forms(value: str) -> list[str]:
    """`value` as it can appear in a message: as is, inside a ``repr`` (how an error quotes a
    key or a tuple holding it) and JSON-escaped; these differ for a quote, a backslash or a
    control character."""
    forms = [value, repr(value)[1:-1]]
    # An environment value that is not valid UTF-8 has no JSON form.
    with contextlib.suppress(orjson.JSONEncodeError):
        forms.append(orjson.dumps(value).decode()[1:-1])
    return list(dict.fromkeys(forms))


def scrub(text: str) -> str:
    """`text` with every credential replaced by ``***``."""
    for form in _secrets()[1]:
        if form in text:
            text = text.replace(form, REDACTED)
    lowered = text.lower()
    for pattern, replacement, hint in _TEXT_PATTERNS:
        if hint in lowered:
            text = pattern.sub(replacement, text)
    return text


class ScrubbedUrl(NamedTuple):
    """A URL without its credentials, and whether it had any."""

    url: str
    had_credentials: bool


_URL = re.compile(_SCHEME)
_SEPARATORS = re.compile("([&;])")


def scrub_url(text: str) -> ScrubbedUrl:
    """`text`, when it is a URL (``scheme://...``), without the credentials it carries: its
    ``user:password@`` part and every query or fragment parameter named like a credential
    (`token`, `write_token`, `api_key`, `key`, `secret`, `password`, `sig`, ...) are left out,
    so that what remains is still a URL a client can use. Any other text is returned as is."""
    if not _URL.match(text):
        return ScrubbedUrl(text, False)
    try:
        parts = urlsplit(text)
    except ValueError:  # not a URL after all (a bad IPv6 host): scrubbed as text
        clean = scrub(text)
        return ScrubbedUrl(clean, clean != text)
    netloc = parts.netloc.rpartition("@")[2]
    query, fragment = _without_credentials(parts.query), _without_credentials(parts.fragment)
    clean = urlunsplit(parts._replace(netloc=netloc, query=query, fragment=fragment))
    changed = (netloc, query, fragment) != (parts.netloc, parts.query, parts.fragment)
    return ScrubbedUrl(clean if changed else text, changed)


def _without_credentials(params: str) -> str:
    """A query (or fragment) without the parameters named like a credential; the others kept
    exactly as written. Parameters are cut at ``&`` and at ``;`` (which servers also take as a
    separator, and `scrub` does), so ``?a=1;token=...`` loses its token too."""
    if "=" not in params:
        return params
    pieces = _SEPARATORS.split(params)  # parameter, separator, parameter, ...
    kept: list[str] = []
    for i in range(0, len(pieces), 2):
        if _CREDENTIAL_PARAM.fullmatch(unquote(pieces[i].partition("=")[0])):
            continue
        if kept:
            kept.append(pieces[i - 1])  # the separator before it
        kept.append(pieces[i])
    return "".join(kept)


def describe(exc: BaseException) -> str:
    """An exception as one line for stats, logs and dead letters, with credentials scrubbed."""
    try:
        text = str(exc)
    except Exception:  # an exception whose message itself fails must not escape from here
        text = "<message unavailable>"
    return scrub(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


def shown(value: object) -> str:
    """A caller's value as an error message quotes it: its ``repr``, with credentials scrubbed."""
    try:
        text = repr(value)
    except Exception:  # a value whose repr fails must not turn into another error
        text = f"<{type(value).__name__}>"
    return scrub(text)


def scrub_bytes(data: bytes, secrets: list[bytes]) -> bytes:
    """`data` (UTF-8 JSON) with credentials replaced; `secrets` from `secret_bytes()`.

    Called for every spooled record, so each pattern runs only when a cheap substring check
    says it could match; a record with no credential costs a few `in` tests.
    """
    for value in secrets:
        if value in data:
            data = data.replace(value, REDACTED.encode())
    for pattern, replacement, char, hints in _BYTES_PATTERNS:
        if char is not None and char not in data:
            continue
        for hint in hints:
            if hint in data:
                data = pattern.sub(replacement, data)
                break
    return data


def generated_run_name() -> str:
    """The run name used when none is given: the local time and a short random suffix."""
    return time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:4]


def check_name(what: str, value: object) -> None:
    """Project and run names become file and directory names in Trackio: refuse anything that
    could point outside its directory (a separator, ``.``/``..``, NUL or another control
    character), or that it could not store (see `check_text`)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty str, got {shown(value)}")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"{what} must not contain NUL or control characters, got {shown(value)}")
    if "/" in value or "\\" in value or value.strip() in (".", ".."):
        raise ValueError(
            f"{what} must be a plain name, not a path (no '/', '\\', '.' or '..'), got {shown(value)}"
        )
    check_text(what, value)


def check_text(what: str, value: str) -> None:
    """`value` can be stored: UTF-8 (what JSON, SQLite and the spool hold) has no form for a lone
    surrogate, so a sink would refuse it only when writing, failing the records batched with it."""
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError:
            raise ValueError(
                f"{what} must be valid Unicode text (no lone surrogates), got {shown(value)}"
            ) from None


class ScrubFilter(logging.Filter):
    """A logging filter that scrubs credentials from every record it sees."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is logging's problem, not ours
            return True
        clean = scrub(message)
        if clean != message:
            record.msg = clean
            record.args = None
        if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
            # An exception's message, or a local variable a formatter may render with it, can
            # hold a URL with its token: handlers get the traceback as scrubbed text only, and
            # no exc_info from which a formatter could render the raw exception or its frames.
            record.exc_text = scrub(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True


_LOGGER_NAME = "asynctrace"

if TYPE_CHECKING:
    _Adapter = logging.LoggerAdapter[logging.Logger]
else:  # not subscriptable at run time before Python 3.11
    _Adapter = logging.LoggerAdapter


class TraceLogger(_Adapter):
    """asynctrace's logger: every module of the package logs through this one object, `logger`.

    Each record goes to the logger that ``logging.getLogger("asynctrace")`` returns at that
    moment, with a `ScrubFilter` on it, and on to `logging.root`: the root that
    `logging.basicConfig`, `dictConfig` and ``logging.getLogger()`` configure. A framework that
    replaces logging's logger manager (AReaL does, on every call of its `getLogger`) breaks both
    halves for a `Logger` kept from import time: ``getLogger("asynctrace")`` then returns a new
    logger (without the filter, without the levels and handlers set on the old one), and a logger
    the new manager makes hangs below a root of its own, which no handler of the trainer's is on.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready: logging.Logger | None = None
        self.extra = None

    @property
    def logger(self) -> logging.Logger:  # type: ignore[override]  # read at each call, never set
        current = logging.getLogger(_LOGGER_NAME)
        if current is not self._ready:
            self._adopt(current)
        return current

    @property
    def level(self) -> int:
        """The level set on the `asynctrace` logger (`setLevel` sets it)."""
        return self.logger.level

    def _adopt(self, current: logging.Logger) -> None:
        """Give a logger first seen under the name its filter, and `logging.root` as its parent
        where a replaced manager gave it a root of its own."""
        with self._lock:
            if not any(isinstance(f, ScrubFilter) for f in current.filters):
                current.addFilter(ScrubFilter())
            parent = current.parent
            if isinstance(parent, logging.RootLogger) and parent is not logging.root:
                current.parent = logging.root
            self._ready = current

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        # A plain LoggerAdapter would replace the call's `extra` with its own.
        return msg, kwargs


logger = TraceLogger()
"""asynctrace's logger (see `TraceLogger`); no module of the package calls `logging.getLogger`."""
