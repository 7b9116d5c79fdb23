"""`python -m commref ...` is the `commref` command."""

import sys

from commref.cli import main

sys.exit(main())
