"""One body of client tests over both drivers (as uvloop's tests run one body per loop):
:class:`AsyncDriven` gives an :class:`aps.AsyncWorker` the blocking :class:`aps.Worker`'s
calls, its coroutines run on an event loop in a thread of its own."""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any

import aps

__all__ = ["DRIVERS", "AsyncDriven", "connect"]

#: Each driver with the transports it speaks: the blocking worker both, the asyncio one TCP.
DRIVERS = [("blocking", "tcp"), ("blocking", "shm"), ("asyncio", "tcp")]


class AsyncDriven:
    """An :class:`aps.AsyncWorker` called as a blocking worker: every coroutine method
    runs to its end on the worker's own loop (a daemon thread); attributes are the
    worker's. Made connected, as ``aps.Worker(...)`` is."""

    def __init__(self, *args: Any, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="aps-test-loop", daemon=True)
        self._thread.start()
        try:
            self._worker = self._run(aps.AsyncWorker.connect(*args, **options))
        except BaseException:
            self._stop()
            raise

    def _run(self, coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._worker, name)
        if inspect.iscoroutinefunction(value):
            return lambda *args, **kwargs: self._run(value(*args, **kwargs))
        return value

    def close(self) -> None:
        try:
            self._run(self._worker.close())
        finally:
            self._stop()

    def _stop(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> AsyncDriven:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def connect(
    driver: str, address: Any, rank: int | None, num_workers: int | None, transport: str = "auto", **options: Any
) -> Any:
    """A worker of ``driver`` (``"blocking"``: :class:`aps.Worker`; ``"asyncio"``: an
    :class:`AsyncDriven` :class:`aps.AsyncWorker`), connected."""
    if driver == "blocking":
        return aps.Worker(address, rank, num_workers, transport, **options)
    return AsyncDriven(address, rank, num_workers, transport, **options)
