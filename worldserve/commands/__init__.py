"""CLI verbs of `worldserve`; each module exposes `add_arguments(parser)` and `run(args) -> int`."""
