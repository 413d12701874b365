"""The warm lowering server: torch, ExecuTorch's Arm backend, the quantizer and Vela imported and warmed up once.

Started by the first client that needs it (:mod:`lowercache.client`), or by
``lowercache server start``. Each request runs in a child forked from the
warm process: the child takes the client's working directory, environment,
``sys.path`` and terminal, runs the CLI exactly as a new process would
(:func:`lowercache.cli.commands.run_in_process`), and its stdout and stderr are
relayed to the client as JSON frames. The server never imports user code, so
every child imports the model file (and the modules it imports) fresh. A
child that crashes, hangs past the request timeout or is killed for memory
takes only its request with it.

One thread, one selector: forking from a process whose other threads may
hold locks can hang the child, and torch's intra-op pool is kept at one
thread in the server for the same reason (each child gets the client's
thread count back).

The rooms: ``protocol`` (what a request may hold), ``loop`` (the accept
loop, the queue, the children, background confirmation), ``child`` (what a
forked child does to become the client and run its request), ``warm`` (what
is imported and warmed up once, and the stamps that say it is current).
"""

from .loop import main

__all__ = ["main"]
