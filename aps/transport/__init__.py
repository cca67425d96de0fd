"""Transports: how frames move between workers and the server.

Both ends: ``framing`` (the one frame parser), ``address`` (``tcp://HOST:PORT``)
and ``segments`` (shared memory and descriptor passing).
Server side: ``session`` (a connection's requests and replies, whatever
carries them), ``tcp_server`` and ``shm_server``.
Client side: ``tcp_client`` and ``shm_client``, over ``_client`` (what both
share).
"""
