"""`python -m attnlens.app.engine COMMANDS_FD RECORDS_FD`: an engine process, as ProcessClient starts it.

It may be started before its model is known (app/server/engine_prestart.py): it imports first,
then waits for its spec; one whose server goes (or never needs it) reads the pipe's end and exits."""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle: it closes us

import sys  # noqa: E402
from multiprocessing.connection import Connection  # noqa: E402

from attnlens.app.engine.messages import Start, decode_to_engine  # noqa: E402
from attnlens.app.engine.worker import main  # noqa: E402

commands = Connection(int(sys.argv[1]), writable=False)
records = Connection(int(sys.argv[2]), readable=False)
try:
    first = commands.recv_bytes()
except EOFError:  # the server went, or started this one early and never needed it
    sys.exit(0)
start = decode_to_engine(first)
assert isinstance(start, Start), f"an engine process starts with its spec, not {start!r}"
main(start.spec, commands, records)
