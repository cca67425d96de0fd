"""The worker side: :class:`aps.Worker` and :class:`aps.AsyncWorker`.

``worker`` (the worker over one channel per server, and every verb once, as
steps) and ``aio`` (the same on asyncio); ``steps`` (one server's calls, as
steps: retry, rejoin, backoff), ``channel`` (the drivers that do those steps'
I/O, blocking or asyncio), ``core`` (requests built, replies parsed: no I/O),
``shards`` (a model cut across several servers), ``recovery``, ``payloads``,
``arguments``; ``sockets``, ``tcp``, ``shm`` (the connections).
"""
