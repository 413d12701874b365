"""Loaded by ``lowercache run`` through PYTHONPATH: cache the Arm steps of this process.

It then hands over to any other ``sitecustomize`` further down the path.
"""

import importlib
import os
import sys

if os.environ.get("LOWERCACHE_RUN") == "1":
    try:
        from lowercache.errors import show_warnings_in_one_line
        from lowercache.runhook import activate_in_process

        show_warnings_in_one_line()
        activate_in_process()
    except Exception as e:  # never break the wrapped program
        print(f"lowercache: warning: caching is off for this process ({e})", file=sys.stderr)

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
del sys.modules["sitecustomize"]
try:
    importlib.import_module("sitecustomize")
except ImportError:
    pass
