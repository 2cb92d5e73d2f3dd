"""Async plumbing shared by the runner, the sweeper and the deployment monitor: database calls from a
coroutine, one event loop per synchronous call, and opening a node's transport from inside a loop."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.conf import settings
from django.db import InterfaceError, OperationalError, connections

from remote.base import Transport, TransportError
from remote.local import LocalTransport

logger = logging.getLogger(__name__)

# Waits between attempts while the database server is away (a PostgreSQL restart takes a few seconds).
RECONNECT_DELAYS_S = (0.5, 1, 2, 4)


def db(func: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    """`func` (an ORM call) for a coroutine: run in the database thread, one call after another, and
    carried over a database restart (see `surviving_database_restarts`)."""
    return sync_to_async(surviving_database_restarts(func), thread_sensitive=True)


def _drop_lost_connections() -> bool:
    """Close the connections that a failed call showed to be dead, so the next call opens a new one
    (Django never does that by itself inside a long task); True if any was lost or never opened."""
    lost = False
    for connection in connections.all(initialized_only=True):
        if connection.connection is None:
            lost = True  # connecting itself failed: the server is not answering yet
        elif connection.errors_occurred and not connection.is_usable():
            connection.close()
            lost = True
    return lost


def surviving_database_restarts(func: Callable[..., Any]) -> Callable[..., Any]:
    """`func`, tried again while the database server is unreachable, for up to
    RAMDECK_DATABASE_OUTAGE_S. A long job's connection dies with a PostgreSQL restart; without this, the
    first query after it fails the step, and the failure cannot even be recorded.

    Only lost connections are retried: a call on a dead connection never reached the server (a restart
    ends idle connections, so the next statement is the one that fails), and a call inside a transaction
    was rolled back with it. Other errors (an integrity error, SQLite's "database is locked") are raised
    as before."""

    @functools.wraps(func)
    def call(*args, **kwargs):
        deadline = time.monotonic() + settings.RAMDECK_DATABASE_OUTAGE_S
        attempt = 0
        while True:
            try:
                return func(*args, **kwargs)
            except (OperationalError, InterfaceError) as exc:
                if not _drop_lost_connections() or time.monotonic() >= deadline:
                    raise
                delay = RECONNECT_DELAYS_S[min(attempt, len(RECONNECT_DELAYS_S) - 1)]
                logger.warning("Database unreachable (%s); trying again in %g s.", str(exc).strip(), delay)
                time.sleep(delay)
                attempt += 1

    return call


# How a job reaches its node's row: set by the nodes app (NodesConfig.ready()), which sits above this one.
_node_transport: Callable[[Any], Transport] | None = None


def register_node_transport(factory: Callable[[Any], Transport]) -> None:
    global _node_transport
    _node_transport = factory


def open_transport(node) -> Transport:
    """The transport for a job's node (not yet connected: use it with `async with`); the console's own host
    when the job has no node. Synchronous: the factory may read the node's credential from the database."""
    if node is None:
        return LocalTransport(
            command_timeout=settings.RAMDECK_COMMAND_TIMEOUT_S,
            output_limit=settings.RAMDECK_COMMAND_OUTPUT_MAX_BYTES,
        )
    if _node_transport is None:
        raise TransportError(f"No transport can reach {node}: the nodes app is not installed.")
    return _node_transport(node)


async def open_transport_for(node) -> Transport:
    """`open_transport` from a coroutine: the factory reads the node's credential in the database thread."""
    return await db(open_transport)(node)


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
