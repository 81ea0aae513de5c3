"""`python -m cronoq_store.testing drive|check|enqueue`: the kit's command line."""

import sys

from .command import main

if __name__ == "__main__":
    sys.exit(main())
