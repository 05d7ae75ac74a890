"""`python -m pagoda.bench ...`: the bench commands without the main `pagoda` CLI."""

import sys

from pagoda.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
