"""`python3 -m tessera ARGS...` runs the `tessera` command line with ARGS (serve, generate, bench,
start, status, ...), e.g. `python3 -m tessera serve MODEL --port 8000`."""

import os
import sys

from tessera import _binary


def main() -> None:
    binary = _binary()
    os.execv(binary, [binary] + sys.argv[1:])


if __name__ == "__main__":
    main()
