"""What a run measures: per-rank timings and trace, memory, FLOPs, measured against predicted."""
