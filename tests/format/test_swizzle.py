import pytest
import torch

from vllm_nvfp4_sm120.format import swizzle_128x4, swizzled_offset, swizzled_shape, unswizzle_128x4


@pytest.mark.parametrize("rows, cols", [(1, 1), (1, 4), (127, 3), (128, 4), (130, 6), (300, 13), (257, 320)])
def test_roundtrip_and_padding(rows, cols, gen):
    s = torch.randint(1, 255, (rows, cols), dtype=torch.uint8, generator=gen)
    sw = swizzle_128x4(s)
    assert sw.shape == swizzled_shape(rows, cols)
    assert torch.equal(unswizzle_128x4(sw, rows, cols), s)
    # padding is zero: every nonzero input byte appears once, nothing else is nonzero
    assert int((sw != 0).sum()) == rows * cols


@pytest.mark.parametrize("rows, cols", [(130, 6), (300, 13)])
def test_offset_formula(rows, cols, gen):
    s = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=gen)
    flat = swizzle_128x4(s).reshape(-1)
    m, k = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    assert torch.equal(flat[swizzled_offset(m, k, cols)], s)


def test_batched(gen):
    s = torch.randint(0, 256, (3, 70, 5), dtype=torch.uint8, generator=gen)
    sw = swizzle_128x4(s)
    assert sw.shape == (3, 128, 8)
    for e in range(3):
        assert torch.equal(sw[e], swizzle_128x4(s[e]))
    assert torch.equal(unswizzle_128x4(sw, 70, 5), s)


def test_e4m3_dtype_kept():
    s = torch.rand(5, 2).to(torch.float8_e4m3fn)
    assert swizzle_128x4(s).dtype == torch.float8_e4m3fn


def test_bad_buffer_size():
    with pytest.raises(ValueError, match="scales: a 128x4-swizzled buffer"):
        unswizzle_128x4(torch.zeros(100, dtype=torch.uint8), 130, 6)


def test_zero_rows():
    sw = swizzle_128x4(torch.zeros(0, 5, dtype=torch.uint8))
    assert sw.shape == (0, 8)
