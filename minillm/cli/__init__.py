"""The `minillm` command line: `main` parses the flags and runs one command.

commands.py  generate, chat, serve, info: each an `add_X` that declares its flags and a `cmd_X`
measure.py   bench and eval: the commands that measure
flags.py     the flag groups several commands share, made from `config.SWITCHES`
"""

from minillm.cli.commands import main

__all__ = ["main"]
