"""pipeplan's files: atomic writes, JSON read with one error, schemas, the newest of each, user file.py."""
