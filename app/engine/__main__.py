"""`python -m attnlens.app.engine COMMANDS_FD RECORDS_FD`: an engine process, as ProcessClient starts it."""

import sys
from multiprocessing.connection import Connection

from attnlens.app.engine.messages import Start, decode_to_engine
from attnlens.app.engine.worker import main

commands = Connection(int(sys.argv[1]), writable=False)
records = Connection(int(sys.argv[2]), readable=False)
start = decode_to_engine(commands.recv_bytes())
assert isinstance(start, Start), f"an engine process starts with its spec, not {start!r}"
main(start.spec, commands, records)
