import pytest
import torch

from goodspeed.lm.kv_slots import SlotKVCache, SlotTable, additive_mask


def test_slot_table_follows_the_cache_when_a_slot_is_freed():
    cache = SlotKVCache(num_layers=1)
    table = SlotTable(cache)
    assert [table.add(k) for k in ("a", "b", "c")] == [0, 1, 2]
    with torch.inference_mode():
        cache.keys[0] = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 1, 4, 1).clone()  # slot s holds the value s
        cache.values[0] = cache.keys[0].clone()
    cache.lengths[:] = [4, 2, 3]
    table.remove("a")  # the last slot ("c") moves into the hole, with its KV and length
    assert table.keys == ["c", "b"] and table.slot("c") == 0 and table.slot("b") == 1 and "a" not in table
    assert cache.lengths == [3, 2] and cache.keys[0][0, 0, :3, 0].tolist() == [2.0, 2.0, 2.0]
    table.remove("b")  # the last slot: nothing moves
    assert table.keys == ["c"] and cache.lengths == [3]
    with pytest.raises(ValueError, match="already has a slot"):
        table.add("c")


def test_additive_mask_is_zero_where_allowed_and_finfo_min_elsewhere():
    allowed = torch.tensor([[[True, False], [True, True]]])
    mask = additive_mask(allowed, torch.float32, "cpu")
    assert mask.shape == (1, 1, 2, 2)
    assert mask[0, 0].tolist() == [[0.0, torch.finfo(torch.float32).min], [0.0, 0.0]]


def test_memory_is_given_back_when_long_sessions_leave():
    """A long prompt grew every buffer to its length; after its slot is freed the buffers shrink
    to what the remaining slots need."""
    cache = SlotKVCache(num_layers=1, initial_capacity=8)
    for _ in range(3):
        cache.add_slot()
    cache.prepare(200, slice(0, 1))  # slot 0 writes 200 positions: capacity grows to 256
    cache.update(torch.ones(1, 2, 200, 4), torch.ones(1, 2, 200, 4), 0)
    cache.commit(0, 0, list(range(200)))
    cache.prepare(3, slice(1, 3))
    cache.update(torch.full((2, 2, 3, 4), 2.0), torch.full((2, 2, 3, 4), 2.0), 0)
    cache.commit(1, 0, [0, 1, 2])
    cache.commit(2, 0, [0, 1, 2])
    assert cache.keys[0].shape[2] == 256
    cache.free_slot(0)  # the long one leaves; slot 2 moves into its place
    assert cache.keys[0].shape == (2, 2, 8, 4) and cache.lengths == [3, 3]
    assert bool((cache.keys[0][:, :, :3] == 2.0).all())  # the others' KV survives the shrink
    cache.free_slot(1)
    cache.free_slot(0)
    assert cache.keys[0].shape[2] == 8  # small buffers are kept for the next sessions
    long = SlotKVCache(num_layers=1, initial_capacity=8)
    long.add_slot()
    long.prepare(100, slice(0, 1))
    long.update(torch.ones(1, 2, 100, 4), torch.ones(1, 2, 100, 4), 0)
    long.commit(0, 0, list(range(100)))
    long.free_slot(0)  # the only (long) session leaves: everything goes
    assert long.keys == [None] and long.values == [None]
