"""The threat model in one place: ways a fast path (the warm server, direct mode, ``run``'s replay) could serve other
bytes than a fresh run, each tried and compared with a fresh uncached run in a new process."""
