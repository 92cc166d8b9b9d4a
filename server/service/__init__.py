"""`mlx-headroom service install | uninstall | status | logs`: run the server under the
machine's supervisor (launchd on macOS, systemd on Linux), restarted when it fails.

    spec.py     what runs: the console script, the serve flags, the secrets file
    base.py     what both supervisors share: paths, private files, running their tools
    launchd.py  macOS LaunchAgent (per user) / LaunchDaemon (--system)
    systemd.py  Linux user unit / system unit (--system)
    cli.py      the command line
"""

from server.service.cli import main

__all__ = ["main"]
