"""Harnesses that drive the product from outside, as vLLM, an RL trainer or a fault would:
the connector driven without an engine (driver), its worker side without vLLM (worker_steps),
vLLM engines run one per process through phases (engine) with the calls they send their
workers (worker_calls: clocks, damage, weight reloads), engines on an LMCache server
(lmcache), the comparison of their outputs (compare) and how far a measured difference can
be trusted (spread), and random sealed chunks for the store's tiers (chunks). Tests, experiments and notebooks use them; nothing in the product
imports them."""
