"""kvlab: how an LLM's KV cache is laid out in memory and what moving it costs.

The core (geometry, layouts, segments, plotting) needs only torch; vLLM and LMCache are
imported only by the modules that use them.
"""

__version__ = "0.1.0"
