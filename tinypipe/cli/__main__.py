"""``python -m tinypipe.cli``: the same as the ``tinypipe`` command."""

from tinypipe.cli import main

raise SystemExit(main())
