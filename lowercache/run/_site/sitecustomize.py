"""Loaded by ``lowercache run`` through PYTHONPATH: record this process and cache the Arm steps of it.

lowercache is imported from beside this directory (the installation that
started the command), then this hands over to any other ``sitecustomize``
further down the path.
"""

import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
if os.environ.get("LOWERCACHE_RUN") == "1":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(_here))))  # lowercache/run/_site: three up
    try:
        from lowercache.errors import show_warnings_in_one_line
        from lowercache.run.hook import activate_in_process
        from lowercache.run.replay import record_in_process

        record_in_process()
        show_warnings_in_one_line()
        activate_in_process()
    except Exception as e:  # never break the wrapped program
        print(f"lowercache: warning: caching is off for this process ({e})", file=sys.stderr)
    finally:
        del sys.path[0]

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
# The next sitecustomize down the path runs as this one's module: deleting this entry from
# sys.modules instead makes the import system fail ("Error in sitecustomize") when there is none.
_next = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
if _next is not None and _next.loader is not None:
    _module = importlib.util.module_from_spec(_next)
    sys.modules["sitecustomize"] = _module
    _next.loader.exec_module(_module)
