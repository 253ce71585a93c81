"""`python -m minillm.cli ...` is the `minillm` command (the tests and `bench serve-http` run it so)."""

import sys

from minillm.cli import main

sys.exit(main())
