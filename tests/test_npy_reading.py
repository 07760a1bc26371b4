import numpy as np
import pytest

from vsekit.data.precomp import DataFormatError
from vsekit.utils.io import open_npy


def test_open_npy_maps_plain_arrays_and_refuses_pickles_and_garbage(tmp_path):
    good = tmp_path / "good.npy"
    np.save(good, np.arange(6, dtype=np.float32).reshape(2, 3))
    a = open_npy(good)
    assert isinstance(a, np.memmap) and a.shape == (2, 3) and a[1, 2] == 5

    pickled = tmp_path / "objects.npy"
    np.save(pickled, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(DataFormatError, match=r"objects\.npy: not a plain numeric \.npy array"):
        open_npy(pickled, DataFormatError)

    garbage = tmp_path / "garbage.npy"
    garbage.write_bytes(b"not numpy at all")
    with pytest.raises(ValueError, match=r"garbage\.npy: "):
        open_npy(garbage)
