"""``python -m pinpool``: the ``pinpool`` command line (pinpool/_cli/)."""

import sys

from ._cli import main

sys.exit(main())
