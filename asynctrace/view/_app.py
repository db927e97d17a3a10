"""The viewer's web app (Starlette): one route per view, state in the URL (its server: `_server`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from importlib import resources

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from . import _pages as pages
from ._archive import Archive
from ._groups import group_page, prompt_page
from ._guard import LOOPBACK, Guard
from ._held import SidecarsRepaired
from ._html import url
from ._loading import Loading
from ._model import StepFilter, prompt_steps
from ._summary import Summary
from ._tokens import token_routes

__all__ = ["Loading", "build_app"]

_STEP_LIMIT = 200
_FIND_LIMIT = 100


class BadRequest(ValueError):
    """A query parameter that is missing or malformed: answered with 400 and the reason."""


def _int(request: Request, name: str, default: int | None = None, minimum: int = -(2**63)) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        if default is None:
            raise BadRequest(f"missing parameter {name!r}")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"{name}: expected an integer, got {raw!r}") from None
    if not minimum <= value < 2**63:  # a step is an int64 in the archive
        raise BadRequest(f"{name}: expected an integer from {minimum} to {2**63 - 1}, got {raw!r}")
    return value


def _float(request: Request, name: str) -> float | None:
    raw = request.query_params.get(name, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise BadRequest(f"{name}: expected a number, got {raw!r}") from None


def _text(request: Request, name: str) -> str:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        raise BadRequest(f"missing parameter {name!r}")
    return raw


def _filters(request: Request) -> StepFilter:
    """A step page's filters from its query: zero=1, truncated=1, tools=1, adv=pos|neg."""
    sign = request.query_params.get("adv", "")
    if sign not in ("", "pos", "neg"):
        raise BadRequest(f"adv: expected pos or neg, got {sign!r}")
    on = {k: request.query_params.get(k, "") not in ("", "0") for k in ("zero", "truncated", "tools")}
    return StepFilter(zero=on["zero"], truncated=on["truncated"], advantage=sign, tools=on["tools"])


def build_app(
    archive: Archive,
    *,
    watch: Sequence[str] = (),
    loading: Loading | None = None,
    hosts: Iterable[str] = LOOPBACK,
    port: int | None = None,
) -> ASGIApp:
    """The app over `archive`; `watch` lists prompt ids the overview links to first. With `loading`,
    pages answer "indexing" (503, refreshed each second) until the archive is indexed. It answers
    only requests whose `Host` is one of `hosts` (with `port`, on that port: see `_guard`)."""
    label = str(archive.path)
    files = resources.files("asynctrace.view").joinpath("static")
    css = files.joinpath("view.css").read_bytes()
    icon = files.joinpath("favicon.svg").read_bytes()

    def kept() -> Summary | None:
        """The kept overview while the index is read, when it answers the overview whole."""
        if loading is None or loading.done.is_set() or loading.summary is None:
            return None
        return loading.summary if not watch or loading.summary.prompts is not None else None

    def page(view: Callable[[Request], Response | str], early: bool = False) -> Callable[[Request], Response]:
        def endpoint(request: Request) -> Response:
            from_summary = early and kept() is not None
            if loading is not None and not from_summary and not loading.done.wait(0.25):
                seconds = time.monotonic() - loading.started
                return HTMLResponse(
                    pages.loading_page(seconds, archive=label), status_code=503, headers={"Retry-After": "1"}
                )
            if loading is not None and loading.error is not None:
                message = f"the archive could not be read: {loading.error}"
                return HTMLResponse(pages.error_page(message, archive=label, title="Error"), status_code=500)
            try:
                try:
                    answer = view(request)
                except SidecarsRepaired:  # a damaged sidecar met, its file read since: ask again
                    answer = view(request)
            except BadRequest as exc:
                return HTMLResponse(
                    pages.error_page(str(exc), archive=label, title="Bad request"), status_code=400
                )
            except LookupError as exc:
                return HTMLResponse(pages.error_page(str(exc.args[0]), archive=label), status_code=404)
            except Exception as exc:  # a file that went away, a query DuckDB refused: said, not hidden
                message = f"this page could not be made: {type(exc).__name__}: {exc}"
                return HTMLResponse(pages.error_page(message, archive=label, title="Error"), status_code=500)
            return HTMLResponse(answer) if isinstance(answer, str) else answer

        return endpoint

    def default_split() -> str:
        splits = archive.splits()
        return "train" if "train" in splits or not splits else splits[0]

    def overview(request: Request) -> str:
        page = _int(request, "page", 1, minimum=1)
        at = _int(request, "step") if request.query_params.get("step") else None
        summary = kept()
        if summary is not None:
            rows, frequent, skipped = summary.overview, summary.frequent[:10], summary.skipped
            counts = summary.prompt_counts(list(watch))
        else:
            rows, frequent = archive.overview(), archive.frequent_prompts()
            counts = archive.prompt_counts(list(watch)) if watch else {}
            skipped = {os.path.basename(f): why for f, why in archive.skipped.items()}
        left_out = {os.path.basename(f): why for f, why in archive.left_out.items()}
        watched = [(p, *counts.get(p, (0, 0))) for p in watch]
        return pages.overview_page(
            rows,
            watched,
            frequent,
            archive=label,
            total=sum(r.samples for r in rows),
            skipped=skipped,
            left_out=left_out,
            page=page,
            at=at,
        )

    def step(request: Request) -> str:
        split = request.query_params.get("split") or default_split()
        number = _int(request, "step")
        order = request.query_params.get("order") or "spread"
        if order not in ("spread", "-spread", "mean", "-mean"):
            raise BadRequest(f"order: expected spread, -spread, mean or -mean, got {order!r}")
        limit = _int(request, "limit", _STEP_LIMIT, minimum=1)
        chosen = _filters(request)
        every = archive.step_groups(split, number, order)
        if not every and not any(r.step == number and r.split == split for r in archive.overview()):
            raise LookupError(f"no records at step {number} of split {split!r}")
        groups = [g for g in every if chosen.keeps(g)]
        if chosen.tools:
            tooled = archive.with_tools(split, number)
            groups = [g for g in groups if g.group in tooled]
        prompts = archive.prompts_of([g.first_id for g in groups[:limit]], split=split, step=number)
        return pages.step_page(
            split,
            number,
            order,
            groups,
            prompts,
            archive=label,
            limit=limit,
            chosen=chosen,
            total=len(every),
            neighbours=archive.neighbours(split, number),
        )

    def group(request: Request) -> str:
        split = request.query_params.get("split") or default_split()
        number = _int(request, "step")
        name = _text(request, "group")
        completions = archive.group(split, number, name)
        if not completions:
            raise LookupError(f"no group {name!r} at step {number} of split {split!r}")
        return group_page(split, number, name, completions, archive=label)

    def prompt(request: Request) -> str:
        prompt_id = _text(request, "id")
        split = request.query_params.get("split") or default_split()
        completions, splits = archive.prompt_history(prompt_id, split)
        if not completions:
            raise LookupError(f"no prompt {prompt_id!r} in split {split!r}")
        return prompt_page(prompt_id, split, splits, prompt_steps(completions), completions, archive=label)

    def record(request: Request) -> str:
        record_id = _text(request, "id")
        found = archive.record(record_id)
        if found is None:
            raise LookupError(f"no record {record_id!r}")
        return pages.record_page(found, archive=label)

    def find(request: Request) -> Response | str:
        query = {k: request.query_params.get(k, "").strip() for k in ("id", "q", "low", "high", "split")}
        if query["id"]:
            return by_id(query["id"])
        low, high = _float(request, "low"), _float(request, "high")
        searched = bool(query["q"]) or low is not None or high is not None
        found = (
            archive.find(text=query["q"] or None, low=low, high=high, split=query["split"], limit=_FIND_LIMIT)
            if searched
            else None
        )
        return pages.find_page(
            found,
            archive=label,
            query=query,
            splits=archive.splits(),
            limit=_FIND_LIMIT,
            text_index=archive.text_progress(),
        )

    def by_id(name: str) -> Response | str:
        """Whatever `name` is the id of: a record, else a prompt, else a group (a list when it
        names several)."""
        record, prompts, groups = archive.names(name)
        if record:
            return RedirectResponse(url("/record", id=name), status_code=303)
        if len(prompts) + len(groups) == 0:
            raise LookupError(f"no record, group or prompt with id {name!r}")
        if prompts and not groups:
            return RedirectResponse(url("/prompt", id=name, split=prompts[0]), status_code=303)
        if len(groups) == 1 and not prompts:
            split, number = groups[0]
            return RedirectResponse(url("/group", split=split, step=number, group=name), status_code=303)
        return pages.names_page(name, prompts, groups, archive=label, splits=archive.splits())

    def static(request: Request) -> Response:
        return Response(css, media_type="text/css", headers={"Cache-Control": "max-age=3600"})

    def favicon(request: Request) -> Response:
        return Response(icon, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})

    routes = [
        Route("/", page(overview, early=True)),
        Route("/step", page(step)),
        Route("/group", page(group)),
        Route("/prompt", page(prompt)),
        *token_routes(archive, page, BadRequest),
        Route("/record", page(record)),
        Route("/find", page(find)),
        Route("/static/view.css", static),
        Route("/static/favicon.svg", favicon),
        Route("/favicon.ico", favicon),
    ]
    return Guard(Starlette(routes=routes), names=hosts, port=port)
