"""``python -m batchgen ...``: the same as the ``batchgen`` command."""

import sys

from batchgen.cli import main

if __name__ == "__main__":
    sys.exit(main())
