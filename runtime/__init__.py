"""pipeplan's runtime: what a cluster node needs to train a generated package (torch only).

It never imports ``partitioner``: a node runs packages with torch and this package alone.
"""

__all__: list[str] = []
