import pytest
import torch

from vllm_nvfp4_sm120.format import E2M1_VALUES, decode_e2m1, pack_e2m1, round_to_e2m1, unpack_e2m1


def test_table_matches_code_bits():
    # s e e m: value = (-1)^s * (m/2 if e == 0 else (1 + m/2) * 2^(e-1))
    for code in range(16):
        s, e, m = code >> 3, (code >> 1) & 3, code & 1
        mag = m / 2 if e == 0 else (1 + m / 2) * 2 ** (e - 1)
        assert E2M1_VALUES[code] == (-mag if s else mag)


def test_round_exact_values_roundtrip():
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(round_to_e2m1(decode_e2m1(codes)), codes)


@pytest.mark.parametrize(
    "x, expected",
    [
        # ties go to the even code (mantissa bit 0)
        (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
        # just off the ties
        (0.2500001, 0.5), (0.7499999, 0.5), (1.2500001, 1.5), (4.9999995, 4.0), (5.0000005, 6.0),
        # saturation
        (6.0, 6.0), (7.0, 6.0), (1e30, 6.0),
    ],
)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_round_nearest_even_and_saturate(x, expected, sign):
    code = round_to_e2m1(torch.tensor([sign * x], dtype=torch.float32))
    assert decode_e2m1(code).item() == sign * expected


def test_negative_underflow_is_negative_zero():
    assert round_to_e2m1(torch.tensor([-0.1, 0.1, -0.0])).tolist() == [8, 0, 8]


@pytest.mark.parametrize("shape", [(1, 2), (3, 10), (2, 5, 32)])
def test_pack_unpack_roundtrip(shape, gen):
    codes = torch.randint(0, 16, shape, dtype=torch.uint8, generator=gen)
    packed = pack_e2m1(codes)
    assert packed.shape == (*shape[:-1], shape[-1] // 2)
    assert torch.equal(unpack_e2m1(packed), codes)


def test_pack_low_nibble_is_even_element():
    assert pack_e2m1(torch.tensor([[0x1, 0xA]], dtype=torch.uint8)).item() == 0xA1


def test_all_bytes_unpack():
    b = torch.arange(256, dtype=torch.uint8).reshape(1, 256)
    assert torch.equal(pack_e2m1(unpack_e2m1(b)), b)


def test_bad_input_names_tensor():
    with pytest.raises(ValueError, match="codes: last dimension must be even"):
        pack_e2m1(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="codes: expected dtype uint8"):
        pack_e2m1(torch.zeros(2, 4, dtype=torch.int32))
