"""`python -m attnlens.app.engine COMMANDS_FD RECORDS_FD`: an engine process, as ProcessClient starts it
(worker.run_from_pipes: it imports first, then waits for its spec)."""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle: it closes us

import sys  # noqa: E402

from attnlens.app.engine.worker import run_from_pipes  # noqa: E402

run_from_pipes(int(sys.argv[1]), int(sys.argv[2]))
