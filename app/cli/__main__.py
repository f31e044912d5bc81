"""`python -m attnlens.app.cli`: the `attnlens` command (app/cli/commands.py)."""

import sys

from attnlens.app.cli.commands import main

sys.exit(main())
