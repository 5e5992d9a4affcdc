"""pipeplan's planning side: model loading, profiling, optimisation and code generation.

The pure parts (``graph``, ``plan``, ``optimizer``) never import torch, so plans can be made and
tested on machines without it.
"""

__all__: list[str] = []
