"""A run's measurements fed back: stage times into the profile, message latency into the cluster."""
