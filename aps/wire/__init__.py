"""The wire: what both ends of a connection share, and no policy.

``protocol`` (the header, the ops, one codec per message), ``framing`` (the
one frame parser), ``segments`` (shared memory: memfd, seals, descriptor
passing), ``net`` (addresses, TLS contexts, socket options) and ``tokens``
(the shared secret: making, storing and checking one).
"""
