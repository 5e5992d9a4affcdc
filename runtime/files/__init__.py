"""pipeplan's files: schemas, the newest of each kind when none is named, a user's file.py imported."""
