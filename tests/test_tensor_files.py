"""safetensors files written by byte ranges from several threads (trainer/tensor_files.py)."""

from __future__ import annotations

import json
import os
import struct
import threading

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from trainer import tensor_files
from trainer.tensor_files import SAFETENSORS_DTYPES, TensorFile, write_tensor_files


def mixed_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Every dtype safetensors stores, a scalar and an empty tensor, large enough to span several pieces."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        f"t{i}.{str(dtype).split('.')[-1]}": (torch.randn(300 + i, generator=generator) * 50).to(dtype)
        for i, dtype in enumerate(SAFETENSORS_DTYPES)
    }
    tensors["scalar"] = torch.tensor(3.5)
    tensors["empty"] = torch.empty(0, 4)
    tensors["matrix"] = torch.randn(64, 33, generator=generator, dtype=torch.float64)
    return tensors


def test_files_written_by_several_threads_at_once_read_back_bit_for_bit(tmp_path, monkeypatch):
    """Pieces of 256 bytes cut the tensors, and the runs of four threads cross from one file into the next; every
    thread writes while the others do (a barrier on each one's first write would break were they one after
    another). safetensors itself reads the files back: the same tensors, dtypes, shapes and metadata."""
    monkeypatch.setattr(tensor_files, "PIECE_BYTES", 256)
    files = [
        TensorFile(tmp_path / "a.safetensors", mixed_tensors(1), {"format": "pt"}),
        TensorFile(tmp_path / "b.safetensors", mixed_tensors(2)),
        TensorFile(tmp_path / "none.safetensors", {}),
    ]
    threads = 4
    all_writing = threading.Barrier(threads, timeout=30)
    first_write: set[int] = set()
    original = os.pwrite

    def pwrite(fd: int, data, offset: int) -> int:
        if threading.get_ident() not in first_write:
            first_write.add(threading.get_ident())
            all_writing.wait()
        return original(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    write_tensor_files(files, threads=threads)
    assert len(first_write) == threads
    for file in files:
        got = load_file(str(file.path))
        assert got.keys() == file.tensors.keys()
        for name, tensor in file.tensors.items():
            assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
            assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
        with safe_open(str(file.path), "pt") as opened:
            assert (opened.metadata() or {}) == file.metadata


def test_each_tensor_starts_at_a_multiple_of_its_element_size(tmp_path):
    """As the library lays files out, so that a load mapping the file reads every tensor aligned."""
    path = tmp_path / "aligned.safetensors"
    tensors = mixed_tensors(3)
    write_tensor_files([TensorFile(path, tensors)], threads=2)
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    assert (8 + header_len) % 8 == 0
    header = json.loads(raw[8 : 8 + header_len])
    for name, tensor in tensors.items():
        begin, end = header[name]["data_offsets"]
        assert begin % tensor.element_size() == 0 and end - begin == tensor.numel() * tensor.element_size(), name
    assert len(raw) == 8 + header_len + max(end for _, end in (h["data_offsets"] for h in header.values()))


@pytest.mark.parametrize(
    "tensor, message", [(torch.randn(4, 6).t(), "contiguous"), (torch.zeros(3, dtype=torch.complex64), "dtype")]
)
def test_a_tensor_it_cannot_write_is_refused_by_name_before_anything_is_written(tmp_path, tensor, message):
    first, bad = tmp_path / "first.safetensors", tmp_path / "bad.safetensors"
    with pytest.raises(ValueError, match=message) as error:
        write_tensor_files(
            [TensorFile(first, {"fine": torch.ones(2)}), TensorFile(bad, {"fine": torch.ones(2), "odd.one": tensor})]
        )
    assert "odd.one" in str(error.value) and not first.exists() and not bad.exists()


def test_a_failing_write_raises(tmp_path, monkeypatch):
    """A full disk reaches the caller (the checkpoint writer removes the folder and keeps the last checkpoint)."""

    def full(fd: int, data, offset: int) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match="No space left"):
        write_tensor_files([TensorFile(tmp_path / "x.safetensors", {"w": torch.ones(1000)})], threads=3)
