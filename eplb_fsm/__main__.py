"""``python -m eplb_fsm`` runs the ``eplb-fsm`` command."""

import sys

from eplb_fsm.cli import main

sys.exit(main())
