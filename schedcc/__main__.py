"""`python -m schedcc` is the `schedcc` command."""

import sys

from schedcc.cli import main

sys.exit(main())
