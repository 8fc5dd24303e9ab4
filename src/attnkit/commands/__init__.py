"""Sub-commands of the ``attnkit`` CLI: each module has ``add_arguments(parser)`` and ``run(args)``.

Command modules import their heavy dependencies inside ``run`` so that ``attnkit --help`` works
with only the core installed.
"""
