"""The searches: given a stage price (``pricing``), find the cuts and replicas that minimise it.

They know no schedule by name: what differs between schedules reaches them as a price, a memory
limit (``pricing.memory.MemoryLimit``) or an objective. ``states`` lists the cuts, ``dp``,
``lattice`` and ``hierarchy`` minimise the slowest stage, ``sync`` the synchronous sum, ``ilp``
either as a MILP, ``candidates`` builds the plans other tools would pick and the candidates of the
laid-out schedules; ``reference`` is PipeDream's plain recurrence, the yardstick of the fast paths.
"""
