"""Async plumbing shared by the runner, the sweeper and the deployment monitor: database calls from a
coroutine, one event loop per synchronous call, and opening a node's transport from inside a loop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.db import connections

from . import transport as transport_module
from .transport import Transport


def db(func: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    """`func` (an ORM call) for a coroutine: run in the database thread, one call after another."""
    return sync_to_async(func, thread_sensitive=True)


async def open_transport_for(node) -> Transport:
    """The node's transport (the console's own host without a node). The factory reads the node's
    credential from the database, so it runs in the database thread."""
    return await db(transport_module.open_transport)(node)


async def with_own_db_thread(awaitable: Awaitable[Any]) -> Any:
    """Await with a database thread of this run's own (for `db` and for bodies' own sync_to_async
    calls), ended and its connection closed afterwards. Without the context, asgiref would use one
    process-wide thread that outlives the run: its connection would linger, and a process forked
    later (a test's live server) would inherit a thread pool whose thread does not exist."""
    async with ThreadSensitiveContext():
        try:
            return await awaitable
        finally:
            # Celery closes the main thread's connection after each task; this thread's is ours.
            await db(connections.close_all)()


def event_loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def run_to_completion(make: Callable[[], Awaitable[Any]]) -> Any:
    """`asyncio.run(make())` for synchronous callers; on a short-lived thread when this thread's own
    event loop is already running (asyncio.run refuses to nest)."""
    if not event_loop_running():
        return asyncio.run(make())
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()
