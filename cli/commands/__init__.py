"""One module per CLI command group; see cli/main.py."""
