"""``python -m batchgen.cli``: the ``batchgen`` command line."""

import sys

from batchgen.cli import main

if __name__ == "__main__":
    sys.exit(main())
