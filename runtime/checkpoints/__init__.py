"""Checkpoints: step folders (which step a resume picks), each rank's save and load, old formats."""
