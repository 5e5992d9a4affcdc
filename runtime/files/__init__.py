"""pipeplan's files: atomic writes, JSON read with one error, schemas, the newest of each kind, a user's file.py."""
