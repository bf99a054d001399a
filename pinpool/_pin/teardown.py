"""One session's teardown as a driver runs it: the lifecycle's (the pool's floor, or the whole fixed pool) and each
elastic segment's, resumed alike when something is raised into it, and abandoned alike after Ctrl-Cs."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, TypeVar

from .outcome import Ran, RunThreads

if TYPE_CHECKING:
    from .._errors import ChunkFailure
    from .._observe import Observer
    from .engine import PinSession

T = TypeVar("T")
TEARDOWN_TRIES = 3  # a teardown something raised in resumes at once this often, then hands it over
ABANDON_AFTER_CTRL_C = 3  # Ctrl-Cs held while a teardown waits on a runtime call: the last gives up on it


def tear_down(
    session: PinSession, observer: Observer, name: str, finish: Callable[[tuple[ChunkFailure, ...]], T], *,
    join: bool = True,
) -> Generator[RunThreads, Ran, tuple[T, list[BaseException]]]:  # fmt: skip
    """Registrars first, then the runtime (threads named ``name``), then ``finish(failures)``: its result and the
    interruptions. What is raised meanwhile, ``finish`` included, resumes it, TEARDOWN_TRIES times, then is raised."""
    interrupts: list[BaseException] = []

    def held(count: int) -> bool:
        """``count`` Ctrl-Cs held while teardown waits: say what it waits on; whether to give up (then leaked)."""
        observer.unpin_waiting(list(session.calls.values()), abandon_after=ABANDON_AFTER_CTRL_C)
        return count >= ABANDON_AFTER_CTRL_C

    for attempt in range(TEARDOWN_TRIES):
        try:
            ran = yield RunThreads(bodies=session.begin_teardown(join=join), name=name, on_held=held)
            interrupts += ran.interrupts
            failures = session.end_teardown(ran.crashed, abandoned=ran.abandoned)
            interrupts += session.take_raised()
            return finish(failures), interrupts
        except GeneratorExit:
            raise  # the driver is gone: a later exit, close() or the finalizer resumes
        except BaseException as exc:
            if attempt == TEARDOWN_TRIES - 1:
                raise
            interrupts.append(exc)
    raise AssertionError("unreachable")
