"""``lowercache build``: a model zoo across targets as one incremental build (docs/build.md).

The build file names the models and targets (:mod:`.buildfile`); the
scheduler (:mod:`.schedule`) answers unchanged pairs from direct-mode
records in this process, without torch, and runs the rest as ``lowercache
lower`` worker processes, here (:mod:`.local`) or as Ray tasks
(:mod:`.onray`); :mod:`.report` writes what came out and what changed.
"""
