"""``python benchmarks/bench.py [options]``: the same as ``dsnorm bench [options]`` from a checkout."""

import sys

from dsnorm.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
