"""A run's options: RunOptions (the launcher's, every rank's) and run.toml."""
