"""``python -m wsarena``: the same command as ``wsarena``."""

from .cli import main

raise SystemExit(main())
