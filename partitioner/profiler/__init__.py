"""The profiler: model spec -> traced layers -> measured ``Profile`` (entry: ``profile.profile_model``)."""
