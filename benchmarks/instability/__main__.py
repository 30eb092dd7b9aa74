"""``python -m benchmarks.instability``: see :mod:`benchmarks.instability.suite`."""

from benchmarks.instability.suite import main

if __name__ == "__main__":
    main()
