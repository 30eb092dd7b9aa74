"""The instability suite: reproducible divergences of small byte-level LMs, scored against the monitor's warnings.

Run ``python -m benchmarks.instability`` (see :mod:`benchmarks.instability.suite`); results in ``docs/instability.md``.
"""
