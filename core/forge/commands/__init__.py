"""One module per ``forge`` sub-command: ``HELP``, ``add_arguments(parser)``, ``run(args)``."""
