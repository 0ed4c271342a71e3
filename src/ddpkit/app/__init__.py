"""The ``ddpkit`` command on top of the library: the command line (``cli``, ``parser``), the ready-made
trainer (``trainer``, ``config``), trackers, plots, ``bench`` and its ``projection``, and ``doctor``.
Nothing in the library imports it."""
