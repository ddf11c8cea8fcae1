"""The broker process: configuration, logging, and serving standalone or as a cluster member
(:mod:`cpgbroker.runtime.process.process`) until a signal. ``cpgbroker start`` runs :func:`main`."""

from __future__ import annotations

import functools
import gc
import logging
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from cpgbroker.model.events import (
    Tick,
)
from cpgbroker.runtime.amqp.server import AmqpServer, open_listeners, wait_for_signal
from cpgbroker.runtime.config.settings import ServerConfig
from cpgbroker.runtime.process import sdnotify

if TYPE_CHECKING:
    from cpgbroker.runtime.process.standalone import StandaloneStore

log = logging.getLogger("cpgbroker.server")


async def serve(
    config: ServerConfig,
    *,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
    node_factory: Callable[[ServerConfig], AmqpServer] | None = None,
    notifier: sdnotify.Notifier | None = None,
) -> None:
    """Serve until cancelled or signalled; reports the bound (host, port) pairs via
    ``task_status`` (port 0 in the config picks a free port). With ``[store]``, the state is
    recovered from the store first and kept in it (runtime/process/standalone.py)."""
    notifier = notifier or sdnotify.Notifier(None)
    stored = None
    if config.store is not None and node_factory is None:
        from cpgbroker.runtime.process.standalone import StandaloneStore

        notifier.status("recovering the store")
        stored = await StandaloneStore.recover(config)
        node = stored.node
    else:
        node = (node_factory or AmqpServer)(config)
    stopped = False
    try:
        await _serve(config, node, stored, task_status, notifier)
        stopped = True
    finally:
        if stored is not None:
            # A stop leaves the store clean; anything else (a failure, a cancelled test)
            # leaves it as a crash would, for the next start to recover.
            stored.close(stopped)
    log.info("stopped")


async def _serve(
    config: ServerConfig,
    node: AmqpServer,
    stored: StandaloneStore | None,
    task_status: trio.TaskStatus[list[tuple[str, int]]],
    notifier: sdnotify.Notifier,
) -> None:
    listeners, bound = await open_listeners(config)
    node.now_ms()
    await node.submit(Tick(node.now_ms()))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(node.ticker)
        if stored is not None:
            nursery.start_soon(stored.run)
        serve_scope = trio.CancelScope()

        async def run_listeners() -> None:
            with serve_scope:
                await trio.serve_listeners(node.handle, listeners, handler_nursery=nursery)

        nursery.start_soon(run_listeners)
        if config.admin_listen:
            from cpgbroker.runtime.admin import endpoint

            standalone = node.standalone
            desk = node.desk
            await nursery.start(
                functools.partial(
                    endpoint.serve_admin,
                    ssl_context=endpoint.admin_ssl_context(config),
                    # The management API and /metrics read the model between events.
                    replica=lambda: None if standalone is None else standalone.broker,
                    users=config.broker.users,
                    cluster_name=config.broker.cluster_name,
                    command=None if desk is None else desk.request,
                ),
                config.admin_listen,
                node.status if stored is None else stored.status,
                None,
                endpoint.load_secret(config),
            )
        task_status.started(bound)
        notifier.ready("serving on " + ", ".join(f"{h}:{p}" for h, p in bound))
        nursery.start_soon(sdnotify.keep_alive, notifier)
        signum = await wait_for_signal()
        notifier.stopping()
        log.info(
            "shutting down signal=%s connections=%d grace=%.1fs",
            signal.Signals(signum).name,
            len(node.local),
            config.shutdown_grace,
        )
        # Graceful: stop accepting, tell every client (320 CONNECTION_FORCED), give them the
        # grace period to take it, then cancel whatever is left.
        serve_scope.cancel()
        for lst in listeners:
            await lst.aclose()
        await node.shutdown_clients(config.shutdown_grace)
        nursery.cancel_scope.cancel()


class _LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        ms = int(record.msecs)
        msg = record.getMessage()
        return f"ts={ts}.{ms:03d}Z level={record.levelname.lower()} logger={record.name} msg={msg}"


def setup_logging(level: str, fmt: str = "logfmt") -> None:
    handler = logging.StreamHandler()
    if fmt == "logfmt":
        handler.setFormatter(_LogfmtFormatter())
    root = logging.getLogger("cpgbroker")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def main(config_path: str | None, listen: str | None, force_boot: bool = False) -> int:
    from cpgbroker.errors import ConfigError
    from cpgbroker.runtime.config import settings as cfgmod

    try:
        cfg = cfgmod.load(config_path, listen)
        if force_boot:
            cfg = cfgmod.with_force_boot(cfg)
    except ConfigError as e:
        print(f"cpgbroker: {e}")
        return 2
    setup_logging(cfg.log_level, cfg.log_format)
    from cpgbroker.errors import ClusterError, CpgError
    from cpgbroker.store.disk import StoreError

    tune_gc()
    # Read (and removed from the environment, so children cannot speak for us) before any
    # child process starts.
    notifier = sdnotify.Notifier.from_env()

    try:
        trio.run(_main_async, cfg, notifier)
    except Exception as e:
        # trio nurseries wrap errors in exception groups; report the one that happened.
        leaf = _single_leaf(e)
        if isinstance(leaf, ConfigError):
            # Found only once serving starts (e.g. an admin secret others can read).
            log.error("cannot serve: %s", leaf)
            return 2
        if isinstance(leaf, OSError):
            log.error("cannot serve: %s", leaf)
            return 1
        if isinstance(leaf, (ClusterError, CpgError, StoreError)):
            # (StoreError: a standalone broker's store cannot be recovered, or failed.)
            log.error("stopped: %s", leaf)
            return 3
        raise
    return 0


def tune_gc() -> None:
    """The broker allocates a few small objects per message and almost never makes reference
    cycles; at the default thresholds the cyclic collector runs every 700 allocations and its
    pauses show up in the latency tail. Collect far less often, and never scan what exists
    at start-up (imports, config)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)


def _single_leaf(e: BaseException) -> BaseException:
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return e


async def _main_async(cfg: ServerConfig, notifier: sdnotify.Notifier) -> Any:
    if cfg.cluster is not None:
        from cpgbroker.runtime.process import process

        await process.serve_member(cfg, notifier=notifier)
    else:
        await serve(cfg, notifier=notifier)
