import pytest
import torch

from goodspeed.verifier.kv_slots import SlotKVCache, SlotTable, additive_mask


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
