"""Building a stage's tensors like the full model's: stage init (copied into every package), helpers."""
