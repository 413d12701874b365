"""``lowercache run``: an unedited export script's lowering steps cached, and an unchanged command replayed (docs/run.md).

:mod:`.launch` starts the command with ``_site``'s ``sitecustomize`` on its
PYTHONPATH; :mod:`.hook` wraps each target family's steps once the script imports its backend;
:mod:`.replay` records the whole process and replays an unchanged run;
:mod:`.pyexec` makes a child of the warm server stand in for a new
``python``; :mod:`.ahead` runs a confined copy of the script ahead of it.
"""
