"""The `dlo` command: a dispatcher only. Each part owns its subcommands in `<part>/cli.py`."""
