"""The launch-plan cache shared by the forward and backward entry points."""
from cuflash._plans import PlanCache


def test_builds_once_per_key_and_bounds_memory():
    cache, built = PlanCache(max_plans=3), []

    def get(key):
        return cache.get(lambda: key, lambda: built.append(key) or f"plan{key}")

    assert get(1) == "plan1" and get(1) == "plan1" and built == [1]
    for k in (2, 3, 4):  # the 4th distinct key empties the full cache first
        get(k)
    assert len(cache) == 1 and built == [1, 2, 3, 4]
    get(1)
    assert built[-1] == 1


def test_unhashable_key_builds_every_time_and_lets_build_raise():
    cache = PlanCache()
    assert cache.get(lambda: ([1],), lambda: "p") == "p"  # an unhashable option: no caching
    assert len(cache) == 0
    try:
        cache.get(lambda: {}, lambda: (_ for _ in ()).throw(ValueError("softmax_scale must be ...")))
    except ValueError as e:
        assert "softmax_scale" in str(e)
    else:
        raise AssertionError("build's error must surface")


def test_lookup_put_and_the_generation_that_clears_bump():
    cache = PlanCache(max_plans=2)
    g0 = cache.generation
    assert cache.lookup(None) is None and cache.lookup(("k",)) is None and cache.lookup([1]) is None
    cache.put(("a",), 1)
    cache.put(("b",), 2)
    assert cache.lookup(("a",)) == 1 and cache.generation == g0
    cache.put(("c",), 3)  # full: emptied first, which outsiders holding plans must notice
    assert cache.generation == g0 + 1 and cache.lookup(("a",)) is None and cache.lookup(("c",)) == 3
    cache.clear()
    assert cache.generation == g0 + 2 and len(cache) == 0
