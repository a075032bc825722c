"""``python -m bench.coordinator``: see :mod:`bench.coordinator`."""

from bench.coordinator.run import main

if __name__ == "__main__":
    main()
