"""``python -m bench.fleet``: see :mod:`bench.fleet`."""

from bench.fleet.run import main

if __name__ == "__main__":
    main()
