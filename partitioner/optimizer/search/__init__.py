"""The searches: given a stage price (``pricing``), find the cuts and replicas that minimise it; they
know no schedule by name (docs/optimizer-search.md)."""
