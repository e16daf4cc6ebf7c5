"""``dsnorm`` console script: one sub-command per job, each implemented in its own module.

Each module named here provides ``add_arguments(parser)`` and ``run(args) -> int``; it is imported
only when its sub-command runs, so ``dsnorm sites`` never pays for numba or Triton.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "bench": ("dsnorm.bench", "verify dsnorm against the reference and time it against the peers"),
    "sites": ("dsnorm.sites", "the DeepSeek-V3.2-Exp RMSNorm sites of a config: shapes and parameters"),
    "count": ("dsnorm.checkpoint", "count the norm tensors of a safetensors checkpoint from its headers"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsnorm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    argv = sys.argv[1:] if argv is None else argv
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        # Only the chosen sub-command's module is imported (its options are needed to parse).
        if argv and argv[0] == name:
            modules[name] = importlib.import_module(module_name)
            modules[name].add_arguments(p)
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
