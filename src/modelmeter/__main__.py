"""``python -m modelmeter``: the same as the ``modelmeter`` command."""

from .cli import main

raise SystemExit(main())
