"""A generated package checked against its own unsplit model before it spends cluster time."""
