"""Engine linear layers in every weight format: float32 panels as accurate as F.linear, 16-bit panels exact over
the rounded weight, GGUF blocks (Q4_0, Q4_1, Q8_0) equal to the integer arithmetic they promise; the same per
row whatever the batch; without kernels exactly F.linear; the caller's model never changed."""

import numpy as np
import pytest
from kernel_builds import kernel_build

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from tfserve.engine import cpu_linear  # noqa: E402
from tfserve.engine.cpu_linear import EngineLinear  # noqa: E402
from tfserve.models.gguf_weights import QuantizedWeight  # noqa: E402

ROWS = (1, 2, 5, 7, 14, 15, 32, 100)


class TorchPanels:
    """The kernels' packing contract in torch, to test EngineLinear's own logic on any CPU."""

    calls = 0

    @staticmethod
    def pack_linear_weight(weight, dtype=None, dot=False):
        assert not dot  # (no bf16_dot attribute: never asked for)
        return weight.to(dtype or weight.dtype).clone()

    @classmethod
    def linear(cls, x, panels, out_features, bias=None):
        cls.calls += 1
        assert panels.shape[0] == out_features
        return torch.nn.functional.linear(x, panels.float(), bias)


@pytest.fixture
def layers():
    torch.manual_seed(0)
    # 100 output features: not a whole number of panels, so the kernel's tail is exercised
    return torch.nn.Linear(64, 100), torch.nn.Linear(100, 40, bias=False)


@pytest.fixture(scope="module", params=["native", pytest.param("x86-64", marks=pytest.mark.slow)])
def ops(request):
    """This CPU's build (its widest vector path), and on x86 the plain C++ one that CPUs without a vector
    path run (built for baseline x86-64)."""
    return kernel_build(request.param)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16"])
def test_the_kernels_serve_every_row_count(layers, fmt):
    TorchPanels.calls = 0
    linear = EngineLinear(layers[0], TorchPanels, fmt)
    assert linear.packed.dtype == getattr(torch, fmt) and linear.label == fmt
    with torch.inference_mode():
        for rows in (1, 5):
            assert linear(torch.randn(rows, 64)).shape == (rows, 100)
    assert TorchPanels.calls == 2


def test_without_kernels_every_row_count_is_f_linear(layers):
    layer = layers[0]
    linear = EngineLinear(layer)
    for rows in ROWS:
        x = torch.randn(rows, 64)
        with torch.inference_mode():
            assert torch.equal(linear(x), torch.nn.functional.linear(x, layer.weight, layer.bias)), rows


def test_the_callers_layers_are_untouched(layers, ops):
    layer = layers[0]
    before = layer.weight.detach().clone()
    for fmt in ("float32", "float16", "int8"):
        EngineLinear(layer, ops, fmt)
    assert "forward" not in vars(layer) and not [name for name in vars(layer) if name.startswith("_tfserve")]
    assert torch.equal(layer.weight, before)


def test_an_unknown_format_is_refused(layers):
    with pytest.raises(ValueError, match="weights must be float32, float16, bfloat16, int8 or gguf"):
        EngineLinear(layers[0], TorchPanels, "float8")


@pytest.mark.parametrize("fmt", ["float32", "float16", "bfloat16"])
def test_panel_kernel_agrees_with_f_linear_over_the_stored_weight(layers, ops, fmt):
    dtype = getattr(torch, fmt)
    for layer in layers:
        linear = EngineLinear(layer, ops, fmt)
        weight = layer.weight.detach().to(dtype).float()  # what the panels hold, widened exactly
        dot = fmt == "bfloat16" and ops.bf16_dot  # the CPU's bfloat16 dot products: inputs rounded to bfloat16
        for rows in ROWS:
            x = torch.randn(rows, layer.in_features)
            seen = x.bfloat16().float() if dot else x
            with torch.inference_mode():
                torch.testing.assert_close(linear(x), torch.nn.functional.linear(seen, weight, layer.bias),
                                           rtol=1e-5, atol=1e-5)
            assert torch.equal(linear.rows(torch.tensor([0, 33, layer.out_features - 1])),
                               weight[[0, 33, layer.out_features - 1]])


def test_bfloat16_dot_products_where_the_cpu_has_them(ops):
    """AVX512-BF16 builds run bfloat16 panels through VDPBF16PS (float32 sums over bfloat16 inputs); an odd
    number of inputs is padded; a build without them refuses dot panels in one line."""
    from tfserve.engine import kernels

    expected = "avx512_bf16" in kernels.cpu_features() and ops.isa == "AVX-512"
    assert ops.bf16_dot == expected
    torch.manual_seed(3)
    w, x = torch.randn(70, 33), torch.randn(5, 33)
    if not ops.bf16_dot:
        with pytest.raises(RuntimeError, match="no bfloat16 dot products"):
            ops.pack_linear_weight(w, torch.bfloat16, dot=True)
        return
    packed = ops.pack_linear_weight(w, torch.bfloat16, dot=True)
    assert packed.shape == (3, 17, 2 * 2 * ops.vec_width)
    expected = x.bfloat16().float() @ w.bfloat16().float().T
    torch.testing.assert_close(ops.linear(x, packed, 70), expected, rtol=1e-5, atol=1e-5)
    # a prompt's rows: tiles of 10-12 rows (the last one shorter), each tile's inputs interleaved; 32+ inputs
    for rows, k in ((37, 33), (200, 96), (13, 70)):
        w, x = torch.randn(70, k), torch.randn(rows, k)
        expected = x.bfloat16().float() @ w.bfloat16().float().T
        got = ops.linear(x, ops.pack_linear_weight(w, torch.bfloat16, dot=True), 70)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_kernels_give_a_row_the_same_bits_in_any_batch(ops, fmt):
    torch.manual_seed(1)
    linear = EngineLinear(torch.nn.Linear(64, 100), ops, fmt)
    rows = torch.randn(40, 64)
    with torch.inference_mode():
        alone = linear(rows[:2])
        for batch in (3, 5, 14, 15, 29, 40):
            assert torch.equal(linear(rows[:batch])[:2], alone), batch


@pytest.mark.parametrize("narrow", ["float16", "bfloat16"])
def test_float32_weights_that_are_16_bit_numbers_are_held_in_16_bits_with_the_same_results(ops, narrow):
    torch.manual_seed(2)
    layer = torch.nn.Linear(64, 100)
    with torch.no_grad():  # a 16-bit checkpoint loaded in float32
        layer.weight.copy_(layer.weight.to(getattr(torch, narrow)).float())
    linear = EngineLinear(layer, ops, "float32")
    # bfloat16 numbers of this size are float16 numbers too (float16 is tried first); not the other way round
    assert linear.packed.dtype in (torch.float16, getattr(torch, narrow)) and linear.label == "float32"
    assert linear.nbytes * 2 == ops.pack_linear_weight(layer.weight.detach(), torch.float32).nbytes
    x = torch.randn(7, 64)
    with torch.inference_mode():
        wide = ops.linear(x, ops.pack_linear_weight(layer.weight.detach(), torch.float32), 100, layer.bias)
        assert torch.equal(linear(x), wide)  # bit for bit: the widened weights are the float32 ones
    with torch.no_grad():  # one weight off the 16-bit grid: float32 panels
        layer.weight[3, 5] += 1e-7 * layer.weight[3, 5].abs() + 1e-9
    assert EngineLinear(layer, ops, "float32").packed.dtype == torch.float32
    assert cpu_linear.exact_16_bit(torch.tensor([0.1])) is None


def test_can_pack_needs_the_kernel_and_float32(layers):
    model = torch.nn.Sequential(*layers)
    assert not cpu_linear.can_pack(model, None)
    assert cpu_linear.can_pack(model, TorchPanels)
    assert not cpu_linear.can_pack(model.to(torch.bfloat16), TorchPanels)


# -- block formats ---------------------------------------------------------------------------------------

BLOCK_TYPES = {"Q4_0": gguf.GGMLQuantizationType.Q4_0, "Q4_1": gguf.GGMLQuantizationType.Q4_1,
               "Q8_0": gguf.GGMLQuantizationType.Q8_0}


def _blocks(weight: torch.Tensor, name: str) -> QuantizedWeight:
    qtype = BLOCK_TYPES[name]
    data = gguf.quants.quantize(weight.numpy(), qtype)
    return QuantizedWeight(np.ascontiguousarray(data.reshape(weight.shape[0], -1)), int(qtype), name)


def _integer_reference(x: torch.Tensor, blocks: QuantizedWeight, out_features: int) -> torch.Tensor:
    """What the block kernels promise, in float64: activations rounded to int8 per block of 32 (scale
    max|x| / 127), each block's integer dot product times both scales, plus the weight block's minimum times
    the exact sum of the activations in it."""
    x = x.double()
    rows, k = x.shape
    xb = x.view(rows, k // 32, 32)
    dx = xb.abs().amax(-1) / 127  # [rows, blocks]
    dx32 = dx.float().double()  # the kernel keeps the scale in float32
    qx = torch.where(dx32[..., None] > 0, torch.round((xb.float() * (1 / dx.float())[..., None]).double()), 0.0)
    raw = blocks.blocks.reshape(out_features, k // 32, -1)
    d = torch.from_numpy(raw[..., :2].copy().view(np.float16).astype(np.float64))[..., 0]  # [out, blocks]
    if blocks.type_name == "Q8_0":
        q = torch.from_numpy(raw[..., 2:].copy().view(np.int8).astype(np.float64))
        m = torch.zeros_like(d)
    else:
        start = 4 if blocks.type_name == "Q4_1" else 2
        nibbles = torch.from_numpy(raw[..., start:].astype(np.int64))
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).double()
        m = (torch.from_numpy(raw[..., 2:4].copy().view(np.float16).astype(np.float64))[..., 0]
             if blocks.type_name == "Q4_1" else -8 * d)
    dots = torch.einsum("rbj,obj->rob", qx, q)  # [rows, out, blocks]
    sums = xb.float().sum(-1).double()  # [rows, blocks]
    return (dots * d[None] * dx32[:, None]).sum(-1) + sums @ m.t()


@pytest.mark.parametrize("name", list(BLOCK_TYPES))
def test_block_kernels_compute_the_integer_arithmetic_they_promise(ops, name):
    torch.manual_seed(2)
    layer = torch.nn.Linear(96, 37, bias=False)  # 3 blocks per row; an odd number of output columns
    blocks = _blocks(layer.weight.detach(), name)
    linear = EngineLinear(layer, ops, "gguf", blocks)
    assert linear.label == name
    for rows in (1, 2, 5, 9):
        x = torch.randn(rows, 96) * torch.linspace(0.1, 4, 96)  # uneven magnitudes, as real activations
        with torch.inference_mode():
            got = linear(x)
        torch.testing.assert_close(got.double(), _integer_reference(x, blocks, 37), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(BLOCK_TYPES))
def test_block_kernels_stay_within_a_stated_error_of_the_float_weights(ops, name):
    """Against F.linear over the same (dequantized) weights, the only error is the activations' int8 rounding:
    under 2% of the output's norm."""
    torch.manual_seed(3)
    layer = torch.nn.Linear(256, 64)
    blocks = _blocks(layer.weight.detach(), name)
    weight = torch.from_numpy(gguf.quants.dequantize(blocks.blocks, BLOCK_TYPES[name])).float()
    linear = EngineLinear(layer, ops, "gguf", blocks)
    x = torch.randn(8, 256)
    with torch.inference_mode():
        ref = torch.nn.functional.linear(x, weight, layer.bias)
        assert ((linear(x) - ref).norm() / ref.norm()).item() < 0.02


def test_int8_is_ggufs_own_q8_0(ops):
    weight = torch.randn(48, 128)
    ours = ops.quantize_q8_0(weight).numpy()
    theirs = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(ours.shape)
    assert np.array_equal(ours, theirs)


@pytest.mark.parametrize("road", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(BLOCK_TYPES))
def test_prompt_rows_multiply_the_exactly_dequantized_weight(ops, name, road):
    """Rows from `float_from` on take the prompt road: bit for bit what float32 panels over GGUF's own
    dequantization give, or (`prompt_dot`, the default where the build has bfloat16 dot products) what the
    bfloat16 dot-product panels over it give; the rows before it keep the integer road."""
    if road == "bfloat16" and not ops.bf16_dot:
        pytest.skip("this build has no bfloat16 dot products")
    torch.manual_seed(4)
    layer = torch.nn.Linear(96, 37, bias=False)
    blocks = _blocks(layer.weight.detach(), name)
    dequantized = torch.nn.Linear(96, 37, bias=False)
    dequantized.weight.data = torch.from_numpy(gguf.quants.dequantize(blocks.blocks, BLOCK_TYPES[name])).float()
    quantized, floats = EngineLinear(layer, ops, "gguf", blocks), EngineLinear(dequantized, ops, road)
    assert quantized.prompt_dot == ops.bf16_dot
    quantized.prompt_dot = road == "bfloat16"
    x = torch.randn(9, 96)
    x[4, 7] = 300.0  # an outlier, which int8 activations would round its block's other values away next to
    with torch.inference_mode():
        mixed = quantized(x, 3)
        assert torch.equal(mixed[3:], floats(x[3:]))
        assert torch.equal(mixed[:3], quantized(x[:3]))
        assert torch.equal(quantized(x, 0), floats(x))
        assert torch.equal(quantized(x[4:5], 0)[0], mixed[4])  # a row alone as in any batch
