"""Slot codec: tensors written into a flat slot come back bit-exact; bad layouts are refused."""

import pytest
import torch

from common.codec import ALIGN, LayoutError, SlotOverflow, TensorSpec, bytes_needed, read_tensors, write_tensors


def _slot(n: int) -> torch.Tensor:
    return torch.full((n,), 0xAB, dtype=torch.uint8)


def _roundtrip(tensors, slot_bytes=1 << 16):
    slot = _slot(slot_bytes)
    layout = write_tensors(slot, tensors)
    wire = [TensorSpec.from_wire(s.to_wire()) for s in layout]
    return read_tensors(slot, wire)


def test_bf16_roundtrip_bit_exact():
    x = torch.randn(17, 33).to(torch.bfloat16)
    out = _roundtrip({"x": x})["x"]
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert torch.equal(out.view(torch.int16), x.view(torch.int16))


def test_every_dtype_and_empty_tensors():
    tensors = {
        "ids": torch.randint(0, 150_000, (100,), dtype=torch.int32),
        "mask": torch.randint(0, 2, (100,), dtype=torch.uint8),
        "empty": torch.empty(0, 4096, dtype=torch.bfloat16),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "flags": torch.tensor([True, False, True]),
        "half": torch.randn(3, 5).half(),
        "ids64": torch.arange(7, dtype=torch.int64),
    }
    out = _roundtrip(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape, name
        assert torch.equal(out[name], t), name


def test_non_contiguous_tensor_is_gathered():
    base = torch.randn(64, 48).to(torch.bfloat16)
    strided = base.t()[::2]
    assert not strided.is_contiguous()
    out = _roundtrip({"s": strided})["s"]
    assert torch.equal(out, strided)


def test_maximal_size_fills_the_slot_exactly():
    slot_bytes = 4096 * ALIGN
    x = torch.randint(0, 255, (slot_bytes,), dtype=torch.uint8)
    slot = _slot(slot_bytes)
    layout = write_tensors(slot, {"x": x})
    assert layout[0].nbytes == slot_bytes
    assert torch.equal(read_tensors(slot, layout)["x"], x)
    with pytest.raises(SlotOverflow, match=str(slot_bytes + 1)):
        write_tensors(slot, {"x": torch.zeros(slot_bytes + 1, dtype=torch.uint8)})


def test_bytes_needed_matches_layout():
    shapes = {"a": ((3, 5), torch.bfloat16), "b": ((7,), torch.int32)}
    slot = _slot(1 << 12)
    layout = write_tensors(slot, {k: torch.zeros(s, dtype=d) for k, (s, d) in shapes.items()})
    assert layout[-1].offset + layout[-1].nbytes <= bytes_needed(shapes)


@pytest.mark.parametrize(
    "wire",
    [
        ["x", "float32", [1 << 20], 0],  # past the slot
        ["x", "complex64", [4], 0],  # dtype not allowed
        ["x", "uint8", [-1], 0],  # negative size
        ["x", "uint8", [4], 3],  # misaligned
        ["x", "uint8", [4], -256],  # negative offset
        ["", "uint8", [4], 0],  # empty name
        ["x", "uint8", 4, 0],  # shape not a list
        ["x", "uint8"],  # short
        ["x", "uint8", [0, 1 << 39, 1 << 39, 1 << 39], 0],  # no elements, but strides past 64 bits (found by fuzzing)
    ],
)
def test_hostile_layouts_are_refused(wire):
    slot = _slot(4096)
    with pytest.raises(LayoutError):
        read_tensors(slot, [TensorSpec.from_wire(wire)])


def test_overlapping_and_duplicate_specs_are_refused():
    slot = _slot(4096)
    a = TensorSpec("a", "uint8", (512,), 0)
    b = TensorSpec("b", "uint8", (512,), 256)
    with pytest.raises(LayoutError, match="overlaps"):
        read_tensors(slot, [a, b])
    with pytest.raises(LayoutError, match="twice"):
        read_tensors(slot, [a, TensorSpec("a", "uint8", (1,), 1024)])


def test_no_layout_reaches_outside_its_slot():
    """20,000 random layouts, most of them hostile, over a slot in the middle of a larger buffer:
    each is refused, or every view it yields lies inside the slot."""
    import random

    from common.codec import DTYPES, MAX_DIMS

    rng = random.Random(3)
    buffer = torch.zeros(3 * 4096, dtype=torch.uint8)
    slot = buffer[4096:8192]
    start, end = slot.data_ptr(), slot.data_ptr() + slot.numel()
    sizes = [0, 1, 2, 3, 255, 256, 1024, 4095, 4096, 4097, 1 << 20, (1 << 40) - 1]
    offsets = [0, 256, 3840, 4096, 8192, 1 << 30, (1 << 50) - 256]
    accepted = 0
    for _ in range(20_000):
        wire = [
            [
                rng.choice(["a", "b", "c"]),
                rng.choice(list(DTYPES)),
                [rng.choice(sizes) for _ in range(rng.randrange(MAX_DIMS + 1))],
                rng.choice(offsets),
            ]
            for _ in range(rng.randrange(1, 4))
        ]
        try:
            views = read_tensors(slot, [TensorSpec.from_wire(item) for item in wire])
        except LayoutError:
            continue
        accepted += 1
        for view in views.values():
            if view.numel():
                assert start <= view.data_ptr() and view.data_ptr() + view.numel() * view.element_size() <= end, wire
    assert accepted > 1000
