"""Waiting for memory pressure without spinning: :class:`PressureWatch` arms the kernel's own
notifications and blocks in ``poll`` until one fires.

Two sources, armed together where both exist:

- a PSI trigger (``<some|full> <stall µs> <window µs>`` written to the process's cgroup v2
  ``memory.pressure``, else ``/proc/pressure/memory``; the file then polls ``POLLPRI`` at most once per
  window while the stall exceeds the threshold). Without CAP_SYS_RESOURCE the kernel takes only windows
  that are multiples of 2 s (and says EINVAL, nothing more, to any other).
- cgroup v1's ``memory.pressure_level`` (``low``: the cgroup reclaims; ``medium``: reclaim is costly
  (swapping, evicting working set); ``critical``: about to OOM), registered through
  ``cgroup.event_control`` with an eventfd. It fires on reclaim against the cgroup's own limit, which
  system-wide PSI barely sees (docs: a page-cache squeeze of a 256 MiB cgroup stalled ~50 ms in all).

Where neither can be armed, :class:`~pinpool.PressureError` says why; the fallback is reading
:func:`~pinpool._host.read_memory_pressure` periodically (every second or two costs a few file reads).
"""

from __future__ import annotations

import errno
import os
import select
from dataclasses import dataclass
from typing import Literal

from .._errors import ConfigError, PressureError
from . import libc
from .limits import binding_memory_cgroup
from .pressure import psi_file

__all__ = ["V1_LEVELS", "PressureEvent", "PressureWatch", "PsiTrigger"]

V1_LEVELS = ("low", "medium", "critical")
_WINDOW_MIN_US, _WINDOW_MAX_US = 500_000, 10_000_000  # the kernel's bounds on a trigger's window
_UNPRIVILEGED_WINDOW_US = 2_000_000  # without CAP_SYS_RESOURCE: multiples of this only
_FALLBACK = "read pressure periodically instead (pinpool._host.read_memory_pressure every 1-2 s)"


@dataclass(frozen=True)
class PsiTrigger:
    """A PSI trigger: fire when tasks stalled on memory ``threshold_us`` within any ``window_us``
    (``kind`` ``"some"``: at least one task; ``"full"``: every non-idle task at once)."""

    kind: Literal["some", "full"] = "some"
    threshold_us: int = 150_000
    window_us: int = 2_000_000

    def __post_init__(self) -> None:
        if self.kind not in ("some", "full"):
            raise ConfigError(f"PsiTrigger kind={self.kind!r}: use 'some' or 'full'")
        for name in ("threshold_us", "window_us"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ConfigError(f"PsiTrigger {name}={value!r}: use a positive whole number of microseconds")
        if not _WINDOW_MIN_US <= self.window_us <= _WINDOW_MAX_US:
            raise ConfigError(
                f"PsiTrigger window_us={self.window_us}: the kernel takes windows from 500000 (0.5 s) to "
                "10000000 (10 s); use 2000000"
            )
        if self.threshold_us > self.window_us:
            raise ConfigError(
                f"PsiTrigger threshold_us={self.threshold_us} is above window_us={self.window_us}: a stall "
                "cannot last longer than its window; use a threshold below the window (for example 10 %)"
            )

    def line(self) -> bytes:
        # The trailing NUL matters: /proc/pressure/* overwrite the last byte written with one, so
        # "some 150000 2000000" would arm a 200000 µs window (EINVAL without CAP_SYS_RESOURCE).
        return f"{self.kind} {self.threshold_us} {self.window_us}\0".encode()


@dataclass(frozen=True)
class PressureEvent:
    """What woke :meth:`PressureWatch.wait`: ``source`` ``"psi"`` (``path``: the PSI file) or
    ``"cgroup_v1"`` (``path``: the cgroup's directory; ``level``: the level registered; ``count``: the
    notifications the kernel coalesced since the last wait)."""

    source: Literal["psi", "cgroup_v1"]
    path: str
    level: str
    count: int = 1


class PressureWatch:
    """Blocks until the kernel reports memory pressure. ``psi``: the trigger to arm (None: none);
    ``v1_level``: the cgroup v1 level to register (None: none); ``psi_path``, ``v1_cgroup``: the file and
    the cgroup directory to use instead of this process's (found as the pressure reader finds them).
    Arms what it can: ``armed`` lists the sources, ``unavailable`` why the others are not; with none
    armed it raises :class:`~pinpool.PressureError`. Not thread-safe: one waiter at a time."""

    def __init__(
        self,
        psi: PsiTrigger | None = PsiTrigger(),  # frozen: one default is safe to share
        v1_level: str | None = "medium",
        *,
        psi_path: str | None = None,
        v1_cgroup: str | None = None,
        root: str = "/",
    ) -> None:
        if v1_level is not None and v1_level.split(",")[0] not in V1_LEVELS:
            raise ConfigError(f"v1_level={v1_level!r}: use 'low', 'medium' or 'critical' (or None: no v1 watch)")
        self._poll = select.poll()
        self._sources: dict[int, PressureEvent] = {}
        self.unavailable: tuple[str, ...] = ()
        self._closed = False
        self._wake: int | None = None
        problems: list[str] = []
        try:
            if psi is not None:
                problem = self._arm_psi(psi, psi_path if psi_path is not None else psi_file(root))
                problems += [problem] if problem else []
            if v1_level is not None:
                problem = self._arm_v1(v1_level, v1_cgroup if v1_cgroup is not None else _v1_directory(root))
                problems += [problem] if problem else []
        except BaseException:
            self.close()
            raise
        self.unavailable = tuple(problems)
        if not self._sources:
            self.close()
            asked = "no source was asked for (psi=None and v1_level=None)" if not problems else "; ".join(problems)
            raise PressureError(f"no memory pressure notification can be armed here: {asked}; {_FALLBACK}", path="")
        # wake() ends a wait from another thread (a pool's policy loop stopping at exit): not a source.
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poll.register(self._wake, select.POLLIN)

    @property
    def armed(self) -> tuple[PressureEvent, ...]:
        """Each armed source, as the event it reports."""
        return tuple(self._sources.values())

    def _arm_psi(self, trigger: PsiTrigger, path: str | None) -> str | None:
        if path is None:
            return "PSI: this kernel has no memory PSI file (CONFIG_PSI off, or psi=0 on its command line)"
        try:
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            return f"PSI: {path} cannot be opened for writing ({errno.errorcode.get(exc.errno or 0, exc)})"
        try:
            os.write(fd, trigger.line())
        except OSError as exc:
            os.close(fd)
            line = trigger.line().decode().rstrip("\0")
            if exc.errno == errno.EINVAL and trigger.window_us % _UNPRIVILEGED_WINDOW_US:
                if not libc.has_capability(libc.CAP_SYS_RESOURCE):
                    raise PressureError(
                        f"the PSI trigger {line!r} was refused by {path}: without CAP_SYS_RESOURCE the kernel "
                        f"takes only windows that are multiples of 2 s; use PsiTrigger(window_us=2000000), or "
                        "grant the process CAP_SYS_RESOURCE",
                        path=path,
                    ) from exc
            return f"PSI: {path} refused the trigger {line!r} ({errno.errorcode.get(exc.errno or 0, exc)})"
        self._add(fd, select.POLLPRI, PressureEvent("psi", path, trigger.kind))
        return None

    def _arm_v1(self, level: str, directory: str | None) -> str | None:
        if directory is None:
            return "cgroup v1: this process is in no cgroup v1 memory hierarchy"
        efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            # The level file is only named in the registration; the kernel holds the cgroup itself.
            level_fd = os.open(os.path.join(directory, "memory.pressure_level"), os.O_RDONLY | os.O_CLOEXEC)
            try:
                control = os.open(os.path.join(directory, "cgroup.event_control"), os.O_WRONLY | os.O_CLOEXEC)
                try:
                    os.write(control, f"{efd} {level_fd} {level}".encode())
                finally:
                    os.close(control)
            finally:
                os.close(level_fd)
        except OSError as exc:
            os.close(efd)
            return (
                f"cgroup v1: memory.pressure_level of {directory} cannot be registered "
                f"({errno.errorcode.get(exc.errno or 0, exc)})"
            )
        self._add(efd, select.POLLIN, PressureEvent("cgroup_v1", directory, level))
        return None

    def _add(self, fd: int, events: int, event: PressureEvent) -> None:
        self._sources[fd] = event
        self._poll.register(fd, events)

    def wait(self, timeout: float | None = None) -> PressureEvent | None:
        """The first notification within ``timeout`` seconds (None: wait for ever), or None at the
        timeout or on :meth:`wake`. Raises :class:`~pinpool.PressureError` when a watched cgroup was removed."""
        if self._closed:
            raise PressureError("the PressureWatch is closed: open a new one", path="")
        ms = None if timeout is None else max(0, int(timeout * 1000))
        for fd, revents in self._poll.poll(ms):
            if fd == self._wake:
                os.eventfd_read(fd)
                return None
            event = self._sources[fd]
            if event.source == "cgroup_v1":
                count = os.eventfd_read(fd)
                # The kernel also signals every registered eventfd when the cgroup goes away.
                if not os.path.isdir(event.path):
                    raise PressureError(
                        f"the watched cgroup {event.path} was removed; open a new PressureWatch", path=event.path
                    )
                return PressureEvent(event.source, event.path, event.level, count)
            if revents & (select.POLLERR | select.POLLNVAL):
                raise PressureError(
                    f"{event.path} stopped delivering PSI events (its cgroup was removed?); open a new PressureWatch",
                    path=event.path,
                )
            return event
        return None

    def wake(self) -> None:
        """End the wait under way (or the next one) with None, from any thread; not after :meth:`close`."""
        wake = self._wake
        if self._closed or wake is None:
            raise PressureError("the PressureWatch is closed: open a new one", path="")
        os.eventfd_write(wake, 1)

    def close(self) -> None:
        """Disarm everything (closing the file disarms a PSI trigger; closing the eventfd, a v1 one)."""
        self._closed = True
        sources, self._sources = self._sources, {}
        for fd in sources:
            os.close(fd)
        wake, self._wake = self._wake, None
        if wake is not None:
            os.close(wake)

    def __enter__(self) -> PressureWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _v1_directory(root: str) -> str | None:
    cgroup = binding_memory_cgroup(root)
    return cgroup[2] if cgroup is not None and cgroup[0] == 1 else None
