"""``python -m lowercache.server``."""

from .loop import main

main()
