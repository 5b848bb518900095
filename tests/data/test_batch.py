import numpy as np
import pytest
import ray
import torch

from workbench import Batch
from workbench.data import PAD_KEY


def make(rows=5):
    return Batch(
        {"x": torch.arange(rows, dtype=torch.float32), "ids": torch.arange(rows * 3).view(rows, 3)},
        {"prompt": [f"p{i}" for i in range(rows)], "truth": [str(i) for i in range(rows)]},
        {"temperature": 1.0},
    )


def test_rows_and_fields_stay_together():
    b = make()
    assert len(b) == 5 and set(b.keys()) == {"x", "ids", "prompt", "truth"}
    part = b[1:3]
    assert part["x"].tolist() == [1.0, 2.0] and list(part["prompt"]) == ["p1", "p2"]
    picked = b[np.array([4, 0])]
    assert picked["ids"][0].tolist() == [12, 13, 14] and list(picked["truth"]) == ["4", "0"]
    assert picked.info == {"temperature": 1.0}


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="different row counts"):
        Batch({"x": torch.zeros(3)}, {"prompt": ["a", "b"]})


def test_chunk_concat_roundtrip_and_uneven_chunk_error():
    b = make(6)
    parts = b.chunk(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    assert Batch.concat(parts).equals(b)
    with pytest.raises(ValueError, match="pad_to_multiple"):
        make(5).chunk(2)


def test_select_and_union():
    b = make()
    s = b.select("x", "prompt")
    assert set(s.keys()) == {"x", "prompt"}
    extra = Batch({"score": torch.ones(5)}, {"uid": list("abcde")})
    u = s.union(extra)
    assert set(u.keys()) == {"x", "prompt", "score", "uid"}
    with pytest.raises(ValueError, match="differs"):
        s.union(Batch({"x": torch.zeros(5)}))
    with pytest.raises(KeyError, match="no field"):
        b.select("nope")


def test_repeat_interleaved_and_tiled():
    b = make(2)
    assert list(b.repeat(3)["prompt"]) == ["p0", "p0", "p0", "p1", "p1", "p1"]
    assert list(b.repeat(2, interleave=False)["prompt"]) == ["p0", "p1", "p0", "p1"]


def test_padding_survives_row_operations_and_is_removed():
    b = make(5)
    padded = b.pad_to_multiple(4)
    assert len(padded) == 8 and padded.num_valid == 5
    assert padded[PAD_KEY].tolist() == [False] * 5 + [True] * 3
    assert list(padded["prompt"][5:]) == ["p0", "p1", "p2"]  # copies of the first rows
    # Chunk, expand (n samples per prompt), join again: still exactly the original rows.
    expanded = Batch.concat([c.repeat(2) for c in padded.chunk(4)])
    assert expanded.num_valid == 10
    assert expanded.unpad().equals(b.repeat(2))
    assert b.pad_to_multiple(5).unpad().equals(b)


def test_pickles_through_ray_object_store(shared_session):
    b = make(4)
    back = ray.get(ray.put(b))
    assert back.equals(b) and back.info == b.info
    assert isinstance(back["prompt"], np.ndarray)


def test_nbytes_counts_tensor_data():
    assert make(5).nbytes == 5 * 4 + 15 * 8
