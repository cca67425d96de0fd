"""The worker side: :class:`aps.Worker` and :class:`aps.AsyncWorker`.

``worker`` (the workers and their request code), ``shards`` (a model cut
across several servers), ``channel`` (the connection to one server: the
handshake and the blocking socket driver), over ``tcp`` or ``shm``.
"""
