"""What a worker works out when it registers its cache: the copy method "auto" picks is the
most preferred one that runs here, as each method declares it, a method registered later too."""

import pytest

from kvlab.cache import allocate, preset
from kvlab.connector.registration import copy_method
from kvlab.transfer import CopyMethod, register, unregister
from kvlab.transfer.methods.segments import copy_segments
from kvlab.transfer.registry import method_status, preferred_methods

CACHE = allocate("BLHNC", preset("smollm2-135m", block_size=16), 4)


def test_auto_takes_the_most_preferred_method_that_runs_here():
    assert preferred_methods()[:2] == ["memcpy", "gather"]
    runs = [name for name in preferred_methods() if method_status(name, CACHE, CACHE) is None]
    assert copy_method("auto", CACHE) == runs[0]


def test_auto_takes_a_method_registered_later():
    register(CopyMethod("mine", copy_segments, colour="#000000", preference=1))
    try:
        assert preferred_methods()[0] == "mine" and copy_method("auto", CACHE) == "mine"
    finally:
        unregister("mine")
    assert copy_method("auto", CACHE) != "mine"


def test_a_method_without_a_preference_is_taken_only_when_asked_for():
    register(CopyMethod("unranked", copy_segments, colour="#000000"))
    try:
        assert "unranked" not in preferred_methods() and copy_method("unranked", CACHE) == "unranked"
    finally:
        unregister("unranked")


def test_a_method_that_cannot_run_here_says_why():
    register(CopyMethod("never", copy_segments, colour="#000000", unavailable=lambda s, d: "not on this machine"))
    try:
        with pytest.raises(ValueError, match="method 'never' cannot run here: not on this machine"):
            copy_method("never", CACHE)
    finally:
        unregister("never")
