"""Rotating API keys and admin tokens without a restart: reload on SIGHUP or on a file change.

A process (worker, gateway, coordinator) that holds :class:`shared.tenants.TenantDirectory`
objects (and, in the coordinator, an admin token) gives them to a :class:`KeyReloader`. On
SIGHUP, or when the config file or ``auth.keys_file`` changes (their mtime and size, looked at
every ``auth.reload_check_s``), it reads the config again and hands the new keys to every
directory in place (:meth:`TenantDirectory.replace`) and the new admin token to ``on_token``.
What the reload removed stays valid for ``auth.rotation_grace_s`` (read from the *new* config),
so clients can move to the new key while the old one still works; after that it is refused.

Only the keys and the admin token change, and what a process's ``on_config`` takes of the new
config (the gateway: ``gateway.version_weights`` and ``version_prefix_tokens``, the steps of a
rollout); every other key of the file is read by its component at start, as before (a reload does
not resize pools or move ports). A file that does
not parse leaves everything as it was and says why in the log (``auth_reload_failed``): a typo
must not lock every client out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from typing import Any

from shared.config import Config, ConfigError, load_config
from shared.tenants import TenantDirectory


def config_loader(path: str | None, overrides: dict[str, Any] | None = None) -> Callable[[], Config] | None:
    """How a process reads its config again, or None when it was not read from a file (nothing
    to reload: a reload of the built-in defaults would drop every key)."""
    path = path or os.environ.get("KVL_CONFIG") or None
    if path is None:
        return None
    return lambda: load_config(path, overrides=overrides)


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


class KeyReloader:
    """Reloads ``auth.keys`` (+ ``auth.keys_file``) and ``coordinator.admin_token`` from ``path``.

    ``load`` reads the config (``shared.config.load_config`` with the process's own overrides);
    ``on_token(token, grace_s)`` receives the admin token the reloaded config names; ``on_config``
    the reloaded config itself (for the few other keys a process takes again); ``counter``
    (a Prometheus counter with an ``outcome`` label) counts reloads, ``ok`` or ``failed``."""

    def __init__(self, load: Callable[[], Config], cfg: Config, log: Any, *, path: str | None = None,
                 directories: tuple[TenantDirectory, ...] = (),
                 on_token: Callable[[str, float], None] | None = None, counter: Any = None,
                 on_config: Callable[[Config], None] | None = None) -> None:
        self.load, self.log, self.path, self.counter = load, log, path, counter
        self.directories, self.on_token, self.on_config = directories, on_token, on_config
        self.check_s = cfg.auth.reload_check_s
        self.keys_file = cfg.auth.keys_file
        self.reloads = self.failures = 0
        self._stamps = self._files_stamps()
        self._task: asyncio.Task[None] | None = None

    def _files_stamps(self) -> tuple[tuple[int, int] | None, ...]:
        return tuple(_stamp(p) for p in (self.path, self.keys_file) if p)

    def reload(self) -> bool:
        """Read the config again and rotate; False (and everything kept) when it cannot be used."""
        self._stamps = self._files_stamps()
        try:
            cfg = self.load()
            new = TenantDirectory.from_config(cfg.auth)
        except ConfigError as e:
            self.failures += 1
            if self.counter is not None:
                self.counter.labels(outcome="failed").inc()
            self.log.error("auth_reload_failed", error=str(e), note="the keys and tokens in use are kept")
            return False
        grace = cfg.auth.rotation_grace_s
        retired = 0
        for d in self.directories:
            retired = d.replace(new, grace)
        if self.on_token is not None:
            self.on_token(cfg.coordinator.admin_token or os.environ.get("KVL_ADMIN_TOKEN", ""), grace)
        if self.on_config is not None:
            self.on_config(cfg)
        self.keys_file = cfg.auth.keys_file
        self._stamps = self._files_stamps()
        self.reloads += 1
        if self.counter is not None:
            self.counter.labels(outcome="ok").inc()
        self.log.info("auth_reloaded", keys=len(new._by_hash), retired_keys_in_grace=retired,  # noqa: SLF001
                      rotation_grace_s=grace)
        return True

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """SIGHUP reloads; and, with ``reload_check_s`` > 0, a change of the files does too."""
        loop = loop or asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        if self.check_s > 0 and self._task is None:
            self._task = loop.create_task(self._watch())

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _watch(self) -> None:
        # NOTE: a change is acted on once the files looked the same at two checks in a row, so a
        # file caught half-written (empty: the defaults, no keys) is not what gets loaded
        seen = self._stamps
        while True:
            await asyncio.sleep(self.check_s)
            now = self._files_stamps()
            if now != self._stamps and now == seen:
                self.reload()
            seen = now


__all__ = ["KeyReloader", "config_loader"]
