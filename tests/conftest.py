"""Suite-wide settings. Hypothesis draws the same examples on every run (``derandomize``), so a
failure in CI is one anyone can reproduce and a pass is not a lucky draw; ``HYPOTHESIS_PROFILE=explore``
draws fresh examples, to hunt for new failures by hand."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))
