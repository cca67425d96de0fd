"""Tools on top of the library, without argparse: ``clock`` (the virtual clock
the simulator drives the real engine on), ``virtual`` (training on it),
``simulate`` and ``compare`` (the paradigms side by side, their reports and
figures) and ``bench`` (the measuring sessions of ``aps bench``). The
commands in :mod:`aps.cli` are their argparse adapters."""
