"""Running coroutines to completion from synchronous code, including code called from a thread
that already runs an event loop (a notebook, an async web app): a thread runs one loop at a
time, so there the coroutines run on a thread of their own. Loops are uvloop's, as in the agent:
a batch of direct reads schedules a few callbacks per object, and uvloop's cost less (measured
with `gpufeed pack` of 30,000 files of 10 KB: 5.5 s instead of 7.0 s)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")
Run = Callable[[Coroutine[Any, Any, Any]], Any]


def _runner() -> asyncio.Runner:
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@contextmanager
def blocking_runner() -> Iterator[Run]:
    """`run(coroutine)` → its result, on one loop for the whole block (so a session opened by
    one call is usable by the next), closed at the end however the block ends."""
    if not _loop_running():
        with _runner() as runner:
            yield runner.run
        return
    with ThreadPoolExecutor(1, thread_name_prefix="gpufeed-loop") as thread:
        runner = thread.submit(_runner).result()
        try:
            yield lambda coroutine: thread.submit(runner.run, coroutine).result()
        finally:
            thread.submit(runner.close).result()


def run_blocking(coroutine: Coroutine[Any, Any, T]) -> T:
    with blocking_runner() as run:
        result: T = run(coroutine)
        return result


async def gather_all(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Await all; then raise the first failure. Unlike a bare gather, no sibling is still
    running (and retrying) when the caller's loop closes."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]
