"""What a newcomer meets first (issue 29): the names ``dir(fshard)`` shows."""

import fshard as fs


def test_dir_lists_the_public_api_only():
    names = dir(fs)
    assert names == sorted(fs.__all__)
    assert "shard" in names and "value_and_grad" in names and "lax" in names
    for internal in ("array", "executor", "planner", "_comm", "spec", "api", "autodiff"):
        assert internal not in names, internal
    assert fs.array.ShardedArray is fs.ShardedArray  # still importable by name
