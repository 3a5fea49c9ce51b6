"""python -m detlogp.bench (see detlogp.bench's docstring or --help)."""

from . import main

raise SystemExit(main())
