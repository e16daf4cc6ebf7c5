"""``dsnorm`` console script: one sub-command per job, each implemented in its own module.

Each module named here provides ``add_arguments(parser)`` and ``run(args) -> int``; it is imported
only when its sub-command runs, so ``dsnorm sites`` never pays for numba or Triton.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS = {
    "bench": ("dsnorm.bench.cli", "verify dsnorm against the reference and time it against the peers"),
    "sites": ("dsnorm.sites", "the DeepSeek-V3.2-Exp RMSNorm sites of a config: shapes and parameters"),
    "count": ("dsnorm.checkpoint", "count the norm tensors of a safetensors checkpoint from its headers"),
}


DESCRIPTION = ("DeepSeek-V3.2-Exp's RMSNorm, exact to the reference: verify and time it, list the "
               "model's norm sites, count a checkpoint's norm tensors.")
# The status of a command killed by SIGPIPE, as a shell reports it (`dsnorm sites --json - | head`).
EXIT_BROKEN_PIPE = 141


def main(argv: list[str] | None = None) -> int:
    from dsnorm import __version__

    parser = argparse.ArgumentParser(prog="dsnorm", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"dsnorm {__version__}")
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
    try:
        status = int(modules[args.command].run(args) or 0)
        sys.stdout.flush()  # a closed reader shows here, not in the interpreter's exit
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and point stdout at /dev/null so that the
        # interpreter's final flush of what is still buffered does not print a second traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return status


if __name__ == "__main__":
    sys.exit(main())
