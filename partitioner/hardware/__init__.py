"""Clusters and devices that are not here: GPUs per node, links per level, what a GPU computes."""
