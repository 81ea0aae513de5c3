"""`python -m cronoq_store.cli`: the `cronoq-store` command."""

import sys

from . import main

sys.exit(main())
