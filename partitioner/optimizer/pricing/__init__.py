"""The cost model, written once: what a stage, a plan and a schedule cost in time and memory.

``stage`` prices one stage (its time, scalar or vectorised); ``schedules`` holds one
``ScheduleModel`` per schedule (its in-flight count, its time per minibatch, whether the simulation
prices it); ``memory`` is the memory model; ``price`` turns stages into a costed ``Plan``;
``simulate`` plays the runtime's own action lists; ``recompute`` prices activation recomputation.
"""
