"""The cost model, written once: what a stage, a plan and a schedule cost in time and memory
(docs/optimizer-pricing.md)."""
