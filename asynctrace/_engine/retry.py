"""Retry policy for sink calls, run by tenacity with anyio's sleep."""

from __future__ import annotations

import random
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)

from .._checks import check_int, check_seconds
from .._security import shown
from ..exceptions import PermanentSinkError

__all__ = ["RetryPolicy"]

T = TypeVar("T")

_FLOAT_MAX = sys.float_info.max


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a failing sink call is retried: exponential backoff with jitter and a per-attempt deadline."""

    max_attempts: int = 5
    initial_backoff: float = 0.1
    max_backoff: float = 10.0
    attempt_timeout: float = 30.0

    def __post_init__(self) -> None:
        check_int("max_attempts", self.max_attempts)
        for name in ("initial_backoff", "max_backoff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number of seconds >= 0, got {shown(value)}")
            if isinstance(value, int) and value > _FLOAT_MAX:
                # The writer sleeps this long between attempts: an int no float holds
                # (10**400) would fail that sleep, in the writer, instead of here.
                raise ValueError(f"{name} must be a number of seconds a float can hold, got {shown(value)}")
        check_seconds("attempt_timeout", self.attempt_timeout)


NO_RETRY = RetryPolicy(max_attempts=1)


def _retryable(exc: BaseException) -> bool:
    # Cancellation (a BaseException on asyncio and trio) must propagate, never be retried.
    return isinstance(exc, Exception) and not isinstance(exc, PermanentSinkError)


async def call_with_retry(
    policy: RetryPolicy,
    fn: Callable[[], Awaitable[T]],
    on_retry: Callable[[BaseException | None], None],
) -> T:
    """Run `fn` under the policy; each attempt is bounded by `attempt_timeout`."""

    async def attempt() -> T:
        with anyio.fail_after(policy.attempt_timeout):
            return await fn()

    # Nearly every call succeeds at once, so the first attempt runs without a tenacity
    # retrier: building one costs several times the attempt's own overhead on every batch.
    try:
        return await attempt()
    except Exception as exc:
        if policy.max_attempts == 1 or not _retryable(exc):
            raise
        on_retry(exc)
    # Attempt 1 failed: the first backoff, then tenacity runs attempts 2..max_attempts. Its
    # attempt k is attempt k + 1 overall, hence the doubled multiplier.
    first_wait = min(policy.initial_backoff, policy.max_backoff)
    await anyio.sleep(first_wait + random.uniform(0, policy.initial_backoff))

    def before_sleep(state: RetryCallState) -> None:
        on_retry(state.outcome.exception() if state.outcome else None)

    retrying = AsyncRetrying(
        stop=stop_after_attempt(policy.max_attempts - 1),
        wait=wait_exponential(multiplier=2 * policy.initial_backoff, max=policy.max_backoff)
        + wait_random(0, policy.initial_backoff),
        retry=retry_if_exception(_retryable),
        sleep=anyio.sleep,
        before_sleep=before_sleep,
        reraise=True,
    )
    return await retrying(attempt)
