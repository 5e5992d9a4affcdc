"""The profiler: model spec -> traced layers -> measured ``Profile`` (the entry is :mod:`partitioner.profiler.profile`)."""
