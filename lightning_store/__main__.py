"""``python -m lightning_store``: check, on this machine, that ``store_on_cpu`` holds and what it costs."""

import sys

from lightning_store._selfcheck import main

if __name__ == "__main__":
    sys.exit(main())
