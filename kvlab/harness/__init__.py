"""The experiments' harness: what drives the product from outside, as vLLM, an RL trainer or a fault would:
the connector driven without an engine (driver), its worker side without vLLM (worker_steps),
vLLM engines run one per process through phases (engine) with the calls they send their
workers (worker_calls: clocks, damage, weight reloads), engines on an LMCache server
(lmcache), the comparison of their outputs (compare) and how far a measured difference can
be trusted (spread), and random sealed chunks for the store's tiers (chunks). The experiments,
the notebooks' words (kvlab.plotting.story reads spread) and the tests use them; the product
below (cache to runtime) never imports them."""
