"""The job: launch, what every rank runs, checks before start, run folders and lock, step log, probe."""
