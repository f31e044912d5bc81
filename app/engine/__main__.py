"""`python -m attnlens.app.engine COMMANDS_FD RECORDS_FD`: an engine process, as ProcessClient starts it."""

import sys
from multiprocessing.connection import Connection

from attnlens.app.engine.wire import receive
from attnlens.app.engine.worker import main

commands = Connection(int(sys.argv[1]), writable=False)
records = Connection(int(sys.argv[2]), readable=False)
main(receive(commands)[1], commands, records)
