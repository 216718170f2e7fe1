"""The machinery diagrams draw their data: each mode's column lists the calls of
kvlab.connector.step_order in order, with a tag per copy, and the prefix hit's hops are
numbered and listed as the data gives them (a drawing that drifts from the data fails)."""

import dataclasses

import matplotlib.patches
import matplotlib.pyplot as plt

from kvlab.connector.step_order import PREFIX_HIT_PATH, STEP_ORDER
from kvlab.plotting.machinery import COPY_COLOURS, prefix_hit_figure, step_calls_figure


def _columns(fig):
    return {ax.get_title(): [t.get_text() for t in ax.texts if t.get_text() not in ("×L",)] for ax in fig.axes}


def _tags(ax):
    return sum(isinstance(p, matplotlib.patches.Rectangle) and p.get_edgecolor() is not None
               and matplotlib.colors.to_hex(p.get_edgecolor()) in {c.lower() for c in COPY_COLOURS.values()}
               for p in ax.patches)


def test_each_column_lists_its_modes_calls_in_order_with_a_tag_per_copy():
    fig = step_calls_figure()
    for ax in fig.axes:
        calls = STEP_ORDER[ax.get_title()]
        assert _columns(fig)[ax.get_title()] == [c.name + (" (hooks)" if c.caller == "hooks" else "") for c in calls]
        assert _tags(ax) == sum(len(c.copies) + len(c.queues) for c in calls)
    plt.close(fig)


def test_the_drawing_follows_the_data():
    swapped = {mode: calls[::-1] for mode, calls in STEP_ORDER.items()}
    fig = step_calls_figure(swapped)
    assert _columns(fig)["hooks"][0] == "update_connector_output"
    plt.close(fig)


def test_the_prefix_hit_lists_and_numbers_every_hop():
    fig = prefix_hit_figure()
    texts = [t.get_text() for t in fig.axes[0].texts]
    for number, hop in enumerate(PREFIX_HIT_PATH, 1):
        assert f"{number}. {hop.call}: {hop.carries}" in [" ".join(t.split()) for t in texts]
        assert str(number) in texts
    plt.close(fig)
    shorter = prefix_hit_figure(PREFIX_HIT_PATH[:2] + (dataclasses.replace(PREFIX_HIT_PATH[2], carries="x"),))
    assert "3. bind_connector_metadata: x" in [t.get_text() for t in shorter.axes[0].texts]
    plt.close(shorter)
