"""``python -m lowercache.cli``: the ``lowercache`` command."""

from . import main

main()
