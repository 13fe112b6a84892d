"""``python -m opacus_structured ...`` = the ``opacus-structured`` command."""

import sys

from .console import main

if __name__ == "__main__":
    sys.exit(main())
