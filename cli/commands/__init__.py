"""One module per CLI command group; see seqcache/cli.py."""
