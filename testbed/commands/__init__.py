"""One module per `testbed` verb; each has `register(subparsers)` and sets `func` on its parser."""
