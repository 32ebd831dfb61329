"""``python -m ficco.selftest`` is ``python -m ficco selftest``."""
import sys

from . import main

if __name__ == "__main__":     # importing the module (doctest collection) runs nothing
    sys.exit(main())
