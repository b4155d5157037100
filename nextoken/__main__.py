"""python -m nextoken -> the CLI."""

from nextoken.cli import main

raise SystemExit(main())
