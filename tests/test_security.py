"""Security: names stay inside their directory, credentials stay out of output, redaction comes first."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys
import textwrap
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

import asynctrace as at
from asynctrace._security import logger, scrub
from tests._util import sample, stuck_spool_session
from tests.faults._harness import ROOT, env

pytestmark = pytest.mark.anyio

HF = "hf_AbCdEfGhIjKlMnOpQrStUvWx1234"
WRITE = "tw-" + "5" * 30
WANDB = "0123456789abcdef" * 2 + "cafebabe"


@pytest.fixture
def tokens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setenv("HF_TOKEN", HF)
    monkeypatch.setenv("TRACKIO_WRITE_TOKEN", WRITE)
    monkeypatch.setenv("WANDB_API_KEY", WANDB)
    return [HF, WRITE, WANDB]


BAD_NAMES = ["../escape", "/etc/passwd", "a/b", "a\\b", "..", ".", "nul\x00byte", "tab\there"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_project_and_run_names_cannot_escape_their_directory(name: str) -> None:
    """A name with a path separator, '.'/'..', NUL or a control character is refused up front."""
    with pytest.raises(ValueError, match="project"):
        at.TraceSession(name, sinks=[at.testing.MemorySink()])
    with pytest.raises(ValueError, match="run"):
        at.TraceSession("ok", run=name, sinks=[at.testing.MemorySink()])
    with pytest.raises(ValueError):
        at.TrackioSink(project=name)


def test_ordinary_names_are_accepted() -> None:
    """Dots, dashes, spaces and unicode inside a name are fine."""
    for name in ("my.model", "grpo-7b_v2", "run 1", "実験"):
        at.TraceSession(name, run=name, sinks=[at.testing.MemorySink()])


def test_scrub_replaces_every_kind_of_credential(tokens: list[str]) -> None:
    """Environment credentials, hf_ tokens, write tokens in URLs and bearer tokens are replaced."""
    text = (
        f"push to https://x.hf.space/api?write_token={WRITE}&a=1 failed with {HF}; "
        f"key {WANDB}; url https://h/?write_token=other-secret-123; Authorization: Bearer abcdefgh12345"
    )
    clean = scrub(text)
    for secret in [*tokens, "other-secret-123", "abcdefgh12345"]:
        assert secret not in clean
    assert "write_token=***" in clean and "a=1" in clean


class _LeakyError(at.Sink):
    """A sink whose errors quote credentials, like a hub client echoing its request URL."""

    name = "leaky"

    async def write(self, records: Sequence[at.TraceRecord]) -> None:
        raise at.PermanentSinkError(f"POST https://hub/upload?write_token={WRITE} token={HF} key={WANDB}")


async def test_no_credential_in_stats_logs_or_dead_letters(
    tmp_path: Path, tokens: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A sink error quoting tokens is scrubbed in stats, log lines and the dead-letter file."""
    caplog.set_level(logging.DEBUG, logger="asynctrace")
    spool = tmp_path / "spool"
    async with at.TraceSession("p", run="r", sinks=[_LeakyError()], spool_dir=spool) as s:
        await s.log_samples([sample(i) for i in range(3)], step=0)
    st = s.stats()
    assert st.failed == 3
    error = st.sinks["leaky"].last_error
    assert error is not None and "write_token=***" in error
    dead = b"".join(p.read_bytes() for p in spool.glob("dead-*.jsonl"))
    assert dead and b"write_token=***" in dead
    for secret in tokens:
        assert secret not in error
        assert secret not in caplog.text
        assert secret.encode() not in dead


async def test_no_credential_in_the_spool_or_the_console(tmp_path: Path, tokens: list[str]) -> None:
    """A token that ended up inside a sample is kept out of the spool files and the console sink."""
    spool = tmp_path / "spool"
    console = io.StringIO()
    leaked = {"prompt": f"my token is {HF}, see https://s/?write_token={WRITE}", "response": WANDB}
    async with at.TraceSession(
        "p",
        run="r",
        sinks=[at.ConsoleSink(console), at.testing.MemorySink(hang=True)],
        spool_dir=spool,
        durability="enqueue",
        finish_timeout=0.5,
        flush_interval=0.01,
    ) as s:
        await s.log_samples([leaked], step=0)
        await anyio.sleep(0.3)
        data = b"".join(p.read_bytes() for p in spool.glob("seg-*.jsonl"))
        assert b"my token is ***" in data
    output = console.getvalue()
    assert "my token is ***" in output
    for secret in tokens:
        assert secret.encode() not in data
        assert secret not in output


async def test_redact_runs_before_encoding_and_before_the_spool(tmp_path: Path) -> None:
    """`redact=` strips PII from prompts before the sample is encoded: sinks and spool never see it."""
    email = re.compile(r"[\w.]+@[\w.]+")

    def redact(s: at.Sample) -> at.Sample:
        messages = [{**m, "content": email.sub("<email>", m["content"])} for m in s.messages]
        metadata = {k: v for k, v in s.metadata.items() if k != "user_id"}
        return at.Sample(messages=messages, metadata=metadata, spans=s.spans, score=s.score)

    spool = tmp_path / "spool"
    sink = at.testing.MemorySink()
    holder = at.testing.MemorySink("held", hang=True)
    pii = {"prompt": "mail jane.doe@example.com about it", "response": "ok", "user_id": "u-1234"}
    async with at.TraceSession(
        "p",
        run="r",
        sinks=[sink, holder],
        spool_dir=spool,
        durability="enqueue",
        redact=redact,
        finish_timeout=0.5,
    ) as s:
        await s.log_samples([pii, at.Sample(messages=[{"role": "user", "content": "x@y.org"}])], step=0)
        data = b"".join(p.read_bytes() for p in spool.glob("seg-*.jsonl"))
    assert b"<email>" in data and b"example.com" not in data and b"u-1234" not in data
    await anyio.sleep(0)
    assert [m["content"] for r in sink.records for m in r.sample.messages] == [
        "mail <email> about it",
        "ok",
        "<email>",
    ]
    assert all("user_id" not in r.sample.metadata for r in sink.records)


async def test_a_failing_redact_is_a_record_error_naming_the_sample() -> None:
    """A redact callable that raises is reported as a RecordError for that sample, like any bad field."""

    def redact(s: at.Sample) -> at.Sample:
        if "secret" in str(s.messages):
            raise KeyError("cannot redact")
        return s

    sink = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[sink], redact=redact) as s:
        with pytest.raises(at.RecordError, match="sample 1"):
            await s.log_samples([sample(0), {"prompt": "secret", "response": "r"}], step=0)
        assert await s.log_samples([sample(2)], step=1) == 1


async def test_json_escaped_and_upper_case_credentials_stay_out_of_the_spool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A credential holding a quote or backslash (JSON-escaped in the payload) and an upper-case
    WRITE_TOKEN= in a URL are scrubbed from spool files too."""
    password = 'pa"ss\\word-1234'
    monkeypatch.setenv("DB_PASSWORD", password)
    spool = tmp_path / "spool"
    async with stuck_spool_session(spool) as s:
        await s.log_samples(
            [
                {
                    "prompt": f"login with {password}",
                    "response": "curl https://h/?WRITE_TOKEN=zzsecretzz99",
                },
                {"prompt": "and", "response": "https://h/?Write_ToKen=mixedcase123"},
            ],
            step=0,
        )
        data = b"".join(p.read_bytes() for p in spool.glob("seg-*.jsonl"))
    assert b"login with ***" in data and b"WRITE_TOKEN=***" in data
    assert b"zzsecretzz99" not in data and b"mixedcase123" not in data and b"word-1234" not in data


async def test_a_redact_error_whose_message_fails_is_still_a_counted_drop() -> None:
    """With on_invalid="skip", a redact raising an exception whose str() itself raises is counted
    as "invalid" instead of escaping to the caller."""

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("__str__ broke")

    def redact(s: at.Sample) -> at.Sample:
        raise Unprintable

    async with at.TraceSession("p", sinks=[at.testing.MemorySink()], redact=redact, on_invalid="skip") as s:
        assert await s.log_samples([sample(0)], step=0) == 0
    assert s.stats().dropped == {"invalid": 1}


def test_numpy_views_and_long_doubles_in_metadata_are_encoded() -> None:
    """Numpy values orjson cannot write itself (a column view, a longdouble) are coerced."""
    import numpy as np
    import orjson

    from asynctrace._records.encode import encode_checked

    m = np.arange(12.0).reshape(3, 4)
    msgs = [{"role": "user", "content": "hi"}]
    meta = {"column": m[:, 0], "long": np.longdouble(0.5), "ints": np.arange(6).reshape(2, 3).T}
    payload, _ = encode_checked(at.Sample(messages=msgs, metadata=meta), 0, None, None)
    assert orjson.loads(payload)["metadata"] == {
        "column": [0.0, 4.0, 8.0],
        "long": 0.5,
        "ints": [[0, 3], [1, 4], [2, 5]],
    }


def _log_failure(fail: Callable[[], None], formatter: logging.Formatter | None = None) -> str:
    """What a handler (with `formatter`, if given) writes when asynctrace logs `fail()`'s error
    with its traceback."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    if formatter is not None:
        handler.setFormatter(formatter)
    # On the logger a trainer configures under the name, asynctrace's records logged as the
    # package logs them: the same whichever framework replaced logging's manager first.
    named = logging.getLogger("asynctrace")
    named.addHandler(handler)
    try:
        try:
            fail()
        except Exception:
            logger.exception("asynctrace: shipping failed")
    finally:
        named.removeHandler(handler)
    return stream.getvalue()


def _unreachable() -> None:
    raise RuntimeError(f"cannot reach https://h/?write_token={WRITE}")


def test_tracebacks_logged_by_asynctrace_are_scrubbed(tokens: list[str]) -> None:
    """A credential in an exception logged with its traceback is scrubbed from the traceback too."""
    output = _log_failure(_unreachable)
    assert "Traceback" in output and "write_token=***" in output
    assert WRITE not in output


class _OwnRendering(logging.Formatter):
    """Renders the traceback from exc_info itself, whatever exc_text holds (as JSON formatters do)."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        elif record.exc_text:
            text += "\n" + record.exc_text
        return text


class _LocalsRendering(_OwnRendering):
    """Also renders the frames' local variables (as rich or structlog can)."""

    def formatException(self, ei: Any) -> str:
        return "".join(traceback.TracebackException(*ei, capture_locals=True).format())


def test_every_module_logs_through_the_one_asynctrace_logger() -> None:
    """No module but _security makes a logger: one kept from its own import would lose the filter
    and the trainer's handlers once a framework replaces logging's manager (see TraceLogger)."""
    package = Path(at.__file__).parent
    makers = [p.name for p in package.rglob("*.py") if "getLogger(" in p.read_text()]
    assert makers == ["_security.py"]


def test_a_formatter_rendering_frame_locals_gets_no_credential(tokens: list[str]) -> None:
    """A formatter that would render the frames' local variables never sees the raw exception."""

    def connect() -> None:
        url = f"https://h/?write_token={WRITE}"  # a local the exception's frame holds
        raise ConnectionError(f"server unreachable ({len(url)})")

    output = _log_failure(connect, _LocalsRendering())
    assert "Traceback" in output and "server unreachable" in output
    assert WRITE not in output


def test_a_formatter_that_renders_exc_info_itself_gets_no_credential(tokens: list[str]) -> None:
    """A formatter that formats exc_info itself (ignoring exc_text) still never sees the token."""
    output = _log_failure(_unreachable, _OwnRendering())
    assert "Traceback" in output and "write_token=***" in output
    assert WRITE not in output


def _assert_clean(exc: BaseException, secrets: Sequence[str]) -> None:
    """No secret, in any form, in an exception's text, its args or its `path`."""
    texts = [str(exc), repr(exc), repr(exc.args), str(getattr(exc, "path", ""))]
    texts.append("".join(traceback.format_exception_only(type(exc), exc)))
    for secret in secrets:
        for text in texts:
            assert secret not in text
            assert repr(secret)[1:-1] not in text


QUOTED = "q'uo\"te\\s-" + "7" * 12  # a credential whose repr differs from its value


@pytest.fixture
def odd_token(monkeypatch: pytest.MonkeyPatch, tokens: list[str]) -> list[str]:
    monkeypatch.setenv("SERVICE_API_KEY", QUOTED)
    return [*tokens, QUOTED]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "make",
    [
        lambda t: {"prompt": "q", t: b"bytes"},  # a key in the field path
        lambda t: {"prompt": "q", "metadata": {"outer": {t: object()}}},  # deeper in the path
        lambda t: {"prompt": "q", "m": {(t, 1): 2}},  # a tuple key's repr
        lambda t: {"prompt": "q", "m": {t: {1: 2}}},  # a path and a non-str key together
        lambda t: {t: "x"},  # a mapping without messages: its keys are listed
    ],
    ids=["key", "nested key", "tuple key", "path and key", "listed keys"],
)
@pytest.mark.parametrize("which", [0, 1, 2, 3])
async def test_record_errors_never_carry_a_credential(
    make: Callable[[str], Any], which: int, odd_token: list[str]
) -> None:
    """A metadata key holding a credential (HF_TOKEN, an env *_API_KEY with quotes in it...) is
    scrubbed from the RecordError's message, args and path, in every way it can appear there."""
    token = odd_token[which]
    async with at.TraceSession("p", sinks=[at.testing.MemorySink()]) as s:
        with pytest.raises(at.RecordError) as info:
            await s.log_samples([make(token)], step=0)
    _assert_clean(info.value, odd_token)
    assert "***" in str(info.value)


_QUOTING_CALLS: list[Callable[[Any, str], object]] = [
    lambda s, t: s.log_samples([sample(0)], step=0, split=t + "\ud800"),
    lambda s, t: s.log_samples([sample(0)], step=0, split=(t,)),
    lambda s, t: s.log_samples([sample(0)], step=(t,)),
    lambda s, t: s.log_metrics({(t,): 1.0}, step=0),
    lambda s, t: s.log_metrics({t: "x"}, step=0),
    lambda s, t: s.log_metrics({"loss": t}, step=0),
    lambda s, t: s.flush(timeout=t),
    lambda s, t: at.TraceSession(t + "/x", sinks=[at.testing.MemorySink()]),
    lambda s, t: at.TraceSession("p", trace_key="{" + t + "}", sinks=[at.testing.MemorySink()]),
    lambda s, t: at.TraceSession("p", on_full=t, sinks=[at.testing.MemorySink()]),
    lambda s, t: at.TraceSession("p", sampler=t, sinks=[at.testing.MemorySink()]),
    lambda s, t: at.TraceSession("p", durability=t, sinks=[at.testing.MemorySink()]),
    lambda s, t: at.TrackioSink(run=t + "/x"),
]


def test_value_errors_never_carry_a_credential(odd_token: list[str]) -> None:
    """Arguments quoted in ValueErrors (a split, a step, a metric name, a timeout, a project name,
    a trace key) are scrubbed too, and no unscrubbed error is chained to them."""
    errors: list[BaseException] = []
    with at.TraceSession("p", sinks=[at.testing.MemorySink()]) as s:
        for token in odd_token:
            for call in _QUOTING_CALLS:
                with pytest.raises(ValueError) as info:
                    call(s, token)
                errors.append(info.value)
    for exc in errors:
        _assert_clean(exc, odd_token)
        chained = [exc.__cause__] + ([] if exc.__suppress_context__ else [exc.__context__])
        for other in chained:
            if other is not None:
                _assert_clean(other, odd_token)


def test_scrub_replaces_the_repr_and_json_forms_of_a_credential(odd_token: list[str]) -> None:
    """A credential quoted through repr() or JSON (escaped quotes, backslashes) is replaced too."""
    import orjson

    text = f"{(QUOTED,)!r} {orjson.dumps(QUOTED).decode()} {QUOTED}"
    clean = scrub(text)
    assert QUOTED not in clean and repr(QUOTED)[1:-1] not in clean
    assert orjson.dumps(QUOTED).decode()[1:-1] not in clean


def test_scrub_follows_changes_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A credential set (or changed) after an earlier scrub is scrubbed too: what scrub caches of
    the environment is read again when the environment changes."""
    first, second = "first-secret-" + "1" * 12, "second-secret-" + "2" * 12
    monkeypatch.setenv("MY_SERVICE_TOKEN", first)
    assert scrub(f"a {first}") == "a ***"
    monkeypatch.setenv("MY_SERVICE_TOKEN", second)
    assert scrub(f"a {first} {second}") == f"a {first} ***"
    monkeypatch.delenv("MY_SERVICE_TOKEN")
    assert scrub(f"a {second}") == f"a {second}"
    with pytest.raises(at.RecordError) as info:
        monkeypatch.setenv("OTHER_API_KEY", first)
        from asynctrace._records.encode import encode_sample

        encode_sample({"prompt": "q", first: b"x"}, 0)
    assert first not in str(info.value) and first not in str(info.value.path)


# A trainer that imports AReaL (which replaces logging's logger manager at import, and again on
# every call of its getLogger), then configures logging, then uses asynctrace.
_AREAL_FIRST = textwrap.dedent(
    """
    import io, json, logging, os
    import areal
    import areal.utils.logging as areal_logging
    import asynctrace as at
    from asynctrace._security import logger

    URL = "https://hub/upload?write_token=" + os.environ["TRACKIO_WRITE_TOKEN"]

    class Leaky(at.Sink):
        name = "upload"
        async def write(self, records):
            raise at.PermanentSinkError("POST " + URL)

    def run():
        with at.TraceSession("p", sinks=[Leaky()], health_metrics=False) as s:
            s.log_samples([{"prompt": "q", "response": "a"}], step=0)
        try:
            raise ConnectionError("cannot reach " + URL)
        except ConnectionError:
            logger.exception("asynctrace: shipping failed")

    root = io.StringIO()
    logging.basicConfig(stream=root, format="%(name)s %(levelname)s %(message)s")
    run()
    first = root.getvalue()
    areal_logging.getLogger("rollout")  # AReaL makes a logger of its own: another manager
    named = io.StringIO()
    logging.getLogger("asynctrace").addHandler(logging.StreamHandler(named))
    run()
    print(json.dumps({"first": first, "root": root.getvalue(), "named": named.getvalue()}))
    """
)


def test_warnings_reach_the_trainers_handlers_after_areal_replaced_the_manager(tokens: list[str]) -> None:
    """With AReaL imported first, asynctrace's warnings and tracebacks reach the handlers the
    trainer configured (basicConfig's, and one on the `asynctrace` logger), scrubbed, and not
    logging's last resort on stderr; also after AReaL swaps the manager again."""
    out = subprocess.run(
        [sys.executable, "-c", _AREAL_FIRST], capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    lines = (
        "asynctrace: sink 'upload' failed to write 1 records for good",
        "asynctrace: session finished with losses",
        "asynctrace: shipping failed",
    )
    # Each run: the three lines, the URL in two of them (the sink's error and the traceback).
    for text, runs in ((seen["first"], 1), (seen["root"], 2), (seen["named"], 1)):
        assert [text.count(line) for line in lines] == [runs] * 3, seen
        assert text.count("write_token=***") == 2 * runs and text.count("Traceback") == runs, seen
        assert all(secret not in text for secret in tokens)
    assert seen["root"].count("asynctrace WARNING") == 4 and seen["root"].count("asynctrace ERROR") == 2
    assert "failed to write" not in out.stderr and "shipping failed" not in out.stderr
