"""Faults: a stopped rank found, a start-up wait naming who never came, dying with the launcher, blame."""
