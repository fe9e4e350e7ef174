"""One module per ``eplb-fsm`` verb: ``add_arguments(parser)`` and ``run(args) -> int``."""
