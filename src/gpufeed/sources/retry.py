"""Retries for store calls: bounded by attempts and time, full-jitter backoff, one warning per
source and kind of failure.

obstore retries each HTTP request itself (3 times: connection errors, 5xx, a GET body that
breaks off), but not a reset it saw too early, a body short of its own Content-Range, a listing
page that does not parse, nor bytes that fail a check; and its retries can run out on a bad
minute. This layer retries the whole call above it. A call marks a failure worth retrying by
raising `Retryable` with the error to raise once retries run out; anything else (not found,
changed, denied, invalid) passes straight through.

A store that stays unreachable through a call's retries is marked down: until a call reaches it
again, one call at a time, at most once a second, tries it once (no retries) and the others fail
at once (`SourceDown`), so a training job or `md5sum *` over a dead store gets its errors in
moments, not one retry budget per file (10,000 uncached files were hours of EIO). A blip
shorter than the retry budget marks nothing, nor does a call that fails while others get
answers.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import NoReturn, TypeVar

from gpufeed.errors import GpufeedError, SourceDown, SourceUnreachable

T = TypeVar("T")

log = logging.getLogger("gpufeed")

RETRIED: Counter[str] = Counter()
"""Attempts this process made again after a failure, by kind: the agent exports its own."""
DOWN_PROBE_S = 1.0
"""While a source is down, how often a call may try it (once, without retries)."""


class Retryable(Exception):
    """A transient failure of kind `kind` ("connection", "server error", "body", "integrity");
    `error` is the gpufeed error the caller sees when no attempt is left."""

    def __init__(self, kind: str, error: Exception) -> None:
        super().__init__(f"{kind}: {error}")
        self.kind = kind
        self.error = error


class RetryPolicy:
    """How one source retries. Delays grow from `base` doubling up to `cap`, each drawn uniformly
    from [0, bound] (full jitter, so clients that failed together do not retry together)."""

    def __init__(
        self,
        where: str,
        timeout: float,
        attempts: int = 5,
        base: float = 0.05,
        cap: float = 2.0,
        rng: random.Random | None = None,
    ) -> None:
        self.where = where
        self.timeout = timeout
        self.attempts = attempts
        self.base = base
        self.cap = cap
        self.rng = rng or random.Random()
        self.warned: set[str] = set()
        self.down_since: float | None = None
        """When a call last ran out of retries on an unreachable store, none having reached it since."""
        self.answered_at = 0.0
        self.probe_at = 0.0
        self.probing = False

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        return self.rng.uniform(0.0, min(self.cap, self.base * 2 ** (attempt - 1)))

    def begin(self) -> Attempts:
        """A call's attempts; while the source is down (see the module doc), one attempt for one
        call at a time, at most once a second, and SourceDown at once for the others. A probe
        that never ends (its task cancelled) stops counting after the retry budget."""
        down = self.down_since
        if down is None:
            return Attempts(self, self.attempts)
        now = time.monotonic()
        if now - self.probe_at < DOWN_PROBE_S or (self.probing and now - self.probe_at < self.timeout):
            raise SourceDown(
                f"{self.where}: cannot reach the store (no answer for {now - down:.0f} s; "
                f"tried again every {DOWN_PROBE_S:g} s until it answers)"
            )
        self.probe_at, self.probing = now, True
        return Attempts(self, 1, probe=True)

    def reached(self) -> None:
        self.down_since, self.probing, self.answered_at = None, False, time.monotonic()

    def unreachable(self, since: float) -> None:
        """A call begun at `since` ran out of retries on an unreachable store: down, unless
        another call got an answer meanwhile (a store slow for one request is not down)."""
        now = time.monotonic()
        if self.down_since is None and self.answered_at <= since:
            self.down_since = self.probe_at = now  # its last attempt was a try: the first probe one second on

    def probe_over(self) -> None:
        """The probe ended (answered, failed, or cancelled): the next may go one second on."""
        self.probing, self.probe_at = False, time.monotonic()

    def note(self, failure: Retryable) -> None:
        """Warn the first time a retry of this source got past this kind of failure; later ones
        are silent, so a flaky store does not flood the log, yet a user learns that it is flaky.
        A call that fails for good says so in its error alone: one line, not two."""
        if failure.kind in self.warned:
            return
        self.warned.add(failure.kind)
        log.warning(
            "%s: %s (%s); retried with backoff, further %s failures of this source are not logged",
            self.where, failure.kind, failure.error, failure.kind,
        )


class Attempts:
    """The attempts of one call. `failed` waits before the next attempt or raises the final
    error; `progress` says an attempt got somewhere: the failures before it are logged and, for
    a long call (a listing), the count restarts."""

    def __init__(self, policy: RetryPolicy, attempts: int, *, probe: bool = False) -> None:
        self.policy = policy
        self.attempts = attempts
        self.probe = probe
        self.began = time.monotonic()
        self.recovered: list[Retryable] = []
        self._restart()

    def progress(self) -> None:
        self.policy.reached()
        if self.probe:  # a probe that got somewhere (a listing's page) goes on as any call
            self.probe, self.attempts = False, self.policy.attempts
        self.began = time.monotonic()  # what fails later fails since this answer
        for failure in self.recovered:
            self.policy.note(failure)
        self.recovered.clear()
        self._restart()

    def _restart(self) -> None:
        self.count = 0
        self.started = time.monotonic()
        self.deadline = self.started + self.policy.timeout

    def _next_delay(self, failure: Retryable) -> float:
        """The wait before the next attempt; none past the deadline. A store that could not be
        reached after a long wait (an endpoint that accepts and never answers, each attempt a
        request timeout under obstore's own retries) is not tried again when another wait as
        long would end past the deadline: the layers' retries would multiply it. A slow failure
        of another kind (a body that breaks off late in a big GET) is retried as before."""
        self.count += 1
        delay = self.policy.delay(self.count)
        now = time.monotonic()
        took, self.started = now - self.started, now + delay
        unreachable = isinstance(failure.error, SourceUnreachable)
        if not unreachable:  # it answered, if not well
            self.policy.reached()
        expected = took if unreachable else 0.0
        if self.count >= self.attempts or now + delay + expected > self.deadline:
            if unreachable:
                self.policy.unreachable(self.began)
            self.over()
            _give_up(failure)
        RETRIED[failure.kind] += 1
        self.recovered.append(failure)
        return delay

    def over(self) -> None:
        """The call ends, however: a probe's end lets the next one go."""
        if self.probe:
            self.probe = False
            self.policy.probe_over()

    def failed(self, failure: Retryable) -> None:
        time.sleep(self._next_delay(failure))

    async def failed_async(self, failure: Retryable) -> None:
        await asyncio.sleep(self._next_delay(failure))


def _give_up(failure: Retryable) -> NoReturn:
    raise failure.error from failure.__cause__


def answered(policy: RetryPolicy, error: GpufeedError) -> None:
    """A final error other than unreachable (not found, denied, changed): the store answered."""
    if not isinstance(error, SourceUnreachable):
        policy.reached()


def call(policy: RetryPolicy, attempt: Callable[[], T]) -> T:
    """`attempt()` until it returns, retrying what it raises as `Retryable`."""
    attempts = policy.begin()
    try:
        while True:
            try:
                result = attempt()
            except Retryable as failure:
                attempts.failed(failure)
            except GpufeedError as error:
                answered(policy, error)
                raise
            else:
                attempts.progress()
                return result
    finally:
        attempts.over()


async def call_async(policy: RetryPolicy, attempt: Callable[[], Awaitable[T]]) -> T:
    """`call` for coroutines: `attempt` makes a fresh awaitable each time."""
    attempts = policy.begin()
    try:
        while True:
            try:
                result = await attempt()
            except Retryable as failure:
                await attempts.failed_async(failure)
            except GpufeedError as error:
                answered(policy, error)
                raise
            else:
                attempts.progress()
                return result
    finally:
        attempts.over()
