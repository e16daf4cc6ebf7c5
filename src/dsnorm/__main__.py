"""``python -m dsnorm``: the ``dsnorm`` console script, for environments without its entry point."""

import sys

from dsnorm.cli import main

sys.exit(main())
