"""ZeRO++ quantizers, TiledLinear's maths, and communication_data_type's resolution (no processes)."""

from __future__ import annotations

import pytest
import torch

from trident.compression.quantize import GRADIENTS, WEIGHTS, BlockQuantizer
from trident.config.loader import load_config
from trident.data_parallel.reducer import communication_dtype
from trident.zero import TiledLinear
from trident.zero.zeropp import switched_on


# -- blockwise quantization --------------------------------------------------------------------------

@pytest.mark.parametrize("quantizer", [WEIGHTS, GRADIENTS, BlockQuantizer(8, 6), BlockQuantizer(4, 2)])
@pytest.mark.parametrize("n", [1, 7, 512, 513, 9001])
def test_every_element_within_half_a_step_of_its_block(quantizer, n):
    g = torch.Generator().manual_seed(n)
    rows = torch.randn(3, n, generator=g) * torch.tensor([[1e-4], [1.0], [300.0]])
    payload = quantizer.quantize(rows)
    assert payload.dtype == torch.uint8 and payload.shape == (3, quantizer.payload_bytes(n))
    err = (quantizer.dequantize(payload, n) - rows).abs()
    assert (err <= quantizer.error_bound(rows)).all()
    assert (quantizer.error_bound(rows) <= rows.abs().max(dim=1, keepdim=True).values / (2 * quantizer.qmax) * 1.01).all()


def test_payload_is_a_quarter_of_fp32_at_8_bits_and_an_eighth_at_4():
    n = 1 << 16
    assert WEIGHTS.payload_bytes(n) == n + 4 * (n // 4096)
    assert GRADIENTS.payload_bytes(n) == n // 2 + 4 * (n // 512)


@pytest.mark.parametrize("quantizer", [WEIGHTS, GRADIENTS])
def test_values_on_the_grid_come_back_exactly(quantizer):
    q = torch.arange(-quantizer.qmax, quantizer.qmax + 1, dtype=torch.float32)
    rows = (q * 0.25).repeat(2, 3)  # steps of 0.25 = absmax / qmax: representable
    assert torch.equal(quantizer.dequantize(quantizer.quantize(rows), rows.shape[1]), rows)


def test_zero_blocks_and_16_bit_inputs():
    zeros = torch.zeros(2, 100)
    assert torch.equal(WEIGHTS.dequantize(WEIGHTS.quantize(zeros), 100), zeros)
    x = torch.randn(2, 300).bfloat16()
    y = GRADIENTS.dequantize(GRADIENTS.quantize(x), 300, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and ((y.float() - x.float()).abs() <= GRADIENTS.error_bound(x.float()) + 1e-2).all()


@pytest.mark.parametrize("bits,block,match", [(2, 64, "bits must be 8 or 4"), (8, 7, "block must be an even"),
                                              (4, 0, "block must be an even")])
def test_bad_quantizer_settings(bits, block, match):
    with pytest.raises(ValueError, match=match):
        BlockQuantizer(bits, block)


# -- TiledLinear -------------------------------------------------------------------------------------

@pytest.mark.parametrize("in_splits,out_splits", [(1, 1), (2, 3), (4, 1), (3, 7)])
@pytest.mark.parametrize("bias", [True, False])
def test_tiled_linear_equals_linear_outputs_and_gradients(in_splits, out_splits, bias):
    torch.manual_seed(0)
    ref = torch.nn.Linear(10, 7, bias=bias)
    tiled = TiledLinear(10, 7, bias=bias, in_splits=in_splits, out_splits=out_splits, init_linear=ref)
    x = torch.randn(3, 5, 10, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = ref(x), tiled(x2)
    torch.testing.assert_close(y2, y, rtol=1e-6, atol=1e-6)
    upstream = torch.randn_like(y)
    y.backward(upstream)
    y2.backward(upstream)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-6, atol=1e-6)
    for o, row in enumerate(tiled.linears):
        r0, r1 = tiled.out_parts[o], tiled.out_parts[o + 1]
        for i, tile in enumerate(row):
            c0, c1 = tiled.in_parts[i], tiled.in_parts[i + 1]
            torch.testing.assert_close(tile.weight.grad, ref.weight.grad[r0:r1, c0:c1], rtol=1e-6, atol=1e-6)
            assert (tile.bias is not None) == (bias and i == in_splits - 1)
            if tile.bias is not None:
                torch.testing.assert_close(tile.bias.grad, ref.bias.grad[r0:r1], rtol=1e-6, atol=1e-6)


def test_tiles_split_features_evenly_first_tiles_larger():
    tiled = TiledLinear(10, 7, in_splits=4, out_splits=3)
    assert tiled.in_parts == [0, 3, 6, 8, 10] and tiled.out_parts == [0, 3, 5, 7]


def test_already_split_input_and_uncombined_outputs():
    torch.manual_seed(0)
    ref = torch.nn.Linear(6, 4)
    tiled = TiledLinear(6, 4, in_splits=2, out_splits=2, input_is_already_split=True, combine_out_splits=False,
                        init_linear=ref)
    x = torch.randn(5, 6)
    outs = tiled(list(x.split([3, 3], dim=-1)))
    torch.testing.assert_close(torch.cat(outs, dim=-1), ref(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="got 3 inputs for in_splits=2"):
        tiled([x, x, x])


@pytest.mark.parametrize("kwargs,match", [
    ({"in_splits": 11}, r"in_splits=11 must be an integer in \[1, in_features=10\]"),
    ({"out_splits": 8}, r"out_splits=8 must be an integer in \[1, out_features=7\]"),
    ({"in_splits": 0}, r"in_splits=0 must be"),
])
def test_splits_larger_than_the_features_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TiledLinear(10, 7, **kwargs)


def test_init_linear_of_another_shape_is_refused():
    with pytest.raises(ValueError, match=r"weight of shape \(7, 9\), expected \(7, 10\)"):
        TiledLinear(10, 7, init_linear=torch.nn.Linear(9, 7))


# -- communication_data_type and the ZeRO++ keys --------------------------------------------------------

@pytest.mark.parametrize("name,compute,expected", [
    (None, torch.float32, torch.float32), (None, torch.bfloat16, torch.bfloat16), (None, torch.float16, torch.float16),
    ("fp32", torch.bfloat16, torch.float32), ("bf16", torch.float32, torch.bfloat16), ("fp16", torch.float32, torch.float16),
])
def test_communication_dtype_follows_deepspeed(name, compute, expected):
    assert communication_dtype(name, compute) is expected


def test_communication_data_type_spellings():
    assert load_config({"communication_data_type": "BF16"}).communication_data_type == "bf16"  # DeepSpeed lower-cases
    assert load_config({}).communication_data_type is None


def test_zeropp_keys_parse_under_stage_3():
    cfg = load_config({"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                                             "zero_quantized_gradients": True}}).zero_optimization
    assert switched_on(cfg) == ["zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size"]
    assert switched_on(load_config({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1}}).zero_optimization) == []
