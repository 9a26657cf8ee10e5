"""sbloader's benchmarks: thin scripts over one shared core (``benchmarks.core``).

Run a script as a file (``python3 benchmarks/run.py --preset quick``) or as a module from the
repository root (``python3 -m benchmarks.run --preset quick``); both run this checkout's
``benchmarks`` and ``sbloader``.
"""
