"""Each notebook's words read from its result rows: the takeaways a notebook ends with and
the readings it shows where it would otherwise type numbers, so its text says what the run on
the page measured, and follows the results when they change. A number carries its sample
count and spread, a comparison claims a difference only beyond the spread, and each reading
names whose run it quotes. One module per notebook or two (layouts: 01 and 07,
transfer: 02, connector: 03 and 04, serving: 04 and 05, accuracy: 06) over the shared wording
(claims); a notebook's headline near its top shows its takeaways (claims.Headline)."""

from kvlab.plotting.story.accuracy import (accuracy_takeaways, connectors_reading, damages_reading,
                                           engine_differences_reading, generations_reading, task_reading)
from kvlab.plotting.story.claims import Headline, Prose, Takeaways, prose, takeaways
from kvlab.plotting.story.connector import (connector_takeaways, cross_layer_takeaways, floor_flags, layouts_reading,
                                            registration_reading, timeline_reading, ttft_reading)
from kvlab.plotting.story.layouts import extension_takeaways, layout_takeaways
from kvlab.plotting.story.serving import (concurrency_reading, deployment_takeaways, lease_reading, lengths_reading,
                                          lookups_reading, pace_reading, profile_reading, scale_reading,
                                          strategies_reading)
from kvlab.plotting.story.tables import conversions_table, engine_sharing_table, layouts_sharing_table, tier_reads_table
from kvlab.plotting.story.transfer import break_even_reading, fit_reading, transfer_takeaways

__all__ = [
    "Headline", "Prose", "Takeaways", "prose", "takeaways", "layout_takeaways", "extension_takeaways", "transfer_takeaways",
    "fit_reading", "break_even_reading", "ttft_reading", "floor_flags", "timeline_reading", "registration_reading",
    "layouts_reading", "connector_takeaways", "cross_layer_takeaways", "deployment_takeaways", "strategies_reading", "lease_reading", "scale_reading",
    "profile_reading", "tier_reads_table", "conversions_table", "layouts_sharing_table", "engine_sharing_table", "lengths_reading", "lookups_reading", "pace_reading", "concurrency_reading",
    "accuracy_takeaways", "engine_differences_reading", "generations_reading", "task_reading", "damages_reading", "connectors_reading",
]
