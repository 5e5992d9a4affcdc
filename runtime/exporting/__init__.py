"""A run in other tools' forms: the unsplit model's weights, the plan as torch's pipelining reads it."""
