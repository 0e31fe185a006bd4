"""``python -m ascend_eplb``: the ``ascend-eplb`` command."""

import sys

from ascend_eplb.cli import main

sys.exit(main())
