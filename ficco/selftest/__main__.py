"""``python -m ficco.selftest`` is ``python -m ficco selftest``."""
import sys

from . import main

sys.exit(main())
