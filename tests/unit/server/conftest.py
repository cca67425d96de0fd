"""What the server's unit tests share: an event loop of their own, set as the current one
(the connections and transports take the current loop when they are made)."""

import asyncio

import pytest


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    asyncio.set_event_loop(None)
    loop.close()
