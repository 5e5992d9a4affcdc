"""A generated package as a rank reads it: import, wiring, its job's layout, its tensors' names."""
