"""The subcommands of ``flamia-verify``, one module each (``add_parser(sub)`` adds its arguments,
``run(args)`` runs it and returns the exit code), and :mod:`~flamia_verify.commands.common`, what they
share. :mod:`flamia_verify.cli` parses the command line and dispatches to them.

No module here imports torch at module level: the command line imports them all before it parses.
"""
