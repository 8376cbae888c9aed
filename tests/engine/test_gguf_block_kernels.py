"""The block kernels over every common GGUF type (Q4_0 .. Q8_0, Q2_K .. Q6_K), against gguf-py's own
dequantize: prompt rows bit for bit what float32 panels over the dequantized weight give, decode rows the
integer arithmetic they promise (int8 activations per block of 32), rows dequantized exactly, a row the same
alone and in any batch; the repacked bytes those of the layout written out in numpy; on this CPU's build, the
AVX2 one and the plain C++ one."""

import numpy as np
import pytest
from kernel_builds import kernel_build

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from tfserve.engine.cpu_linear import EngineLinear, fused
from tfserve.models.gguf_weights import QuantizedWeight

T = gguf.GGMLQuantizationType
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# where each K-quant block keeps its float16 scales, and a size for them that gives weights of about 0.05
K_SCALES = {"Q2_K": ((80, 2e-3), (82, 2e-3)), "Q3_K": ((108, 1e-3),), "Q4_K": ((0, 2e-4), (2, 2e-4)),
            "Q5_K": ((0, 1e-4), (2, 1e-4)), "Q6_K": ((208, 5e-5),)}
# the bytes of a block that hold its quants, and whether the integer road counts its (weight at quant 0) as a
# minimum times the activations' exact sum (the others multiply all of the weight by the int8 activations)
QUANT_BYTES = {"Q4_0": (2, 18), "Q4_1": (4, 20), "Q5_1": (4, 24), "Q2_K": (16, 80), "Q4_K": (16, 144),
               "Q5_K": (16, 176)}
N, K = 37, 512  # out_features: not whole groups of 8 nor whole panels; in_features: two super-blocks
ROWS = (1, 2, 5, 8, 13, 33)


@pytest.fixture(scope="module", params=["native", pytest.param("x86-64-v3", marks=pytest.mark.slow),
                                        pytest.param("cascadelake", marks=pytest.mark.slow),
                                        pytest.param("skylake-avx512", marks=pytest.mark.slow),
                                        pytest.param("x86-64", marks=pytest.mark.slow)])
def ops(request):
    """This CPU's build, and on x86 the AVX2 one (on an AVX-512 CPU), the AVX-512 ones without bfloat16 dot
    products (with and without VNNI) and the plain C++ one."""
    return kernel_build(request.param)


def make_blocks(name: str, n: int = N, k: int = K, seed: int = 0) -> np.ndarray:
    """Valid blocks uint8 [n, bytes per row]: gguf-py's own quantization of random weights where it has one,
    else random bytes with float16 scales of a realistic size (every bit pattern of the rest is a valid block)."""
    rng = np.random.default_rng(seed)
    qtype = T[name]
    if name in K_SCALES:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (n, k // block_size, type_size), dtype=np.uint8)
        for offset, size in K_SCALES[name]:
            scale = (size * rng.uniform(0.5, 1.5, (n, k // block_size, 1))).astype(np.float16)
            blocks[..., offset:offset + 2] = scale.view(np.uint8)
        return blocks.reshape(n, -1)
    weight = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    return np.ascontiguousarray(gguf.quants.quantize(weight, qtype).reshape(n, -1))


def dequantized(name: str, blocks: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, T[name]).reshape(blocks.shape[0], -1).copy()).float()


def integer_reference(name: str, blocks: np.ndarray, x: torch.Tensor) -> torch.Tensor:
    """What the decode road promises, in float64: activations rounded to int8 per block of 32 (scale max|x| / 127,
    kept in float32) times the dequantized weight; for the types with a minimum (and Q4_0's -8 d), the weight at
    quant 0 times the exact activations instead."""
    rows, k = x.shape
    xb = x.view(rows, k // 32, 32)
    dx = xb.abs().amax(-1) / 127
    qx = torch.where(dx[..., None] > 0, torch.round(xb * (1 / dx)[..., None]), 0.0)
    x_int8 = (qx.double() * dx.double()[..., None]).view(rows, k)
    weight = dequantized(name, blocks).double()
    if name not in QUANT_BYTES:
        return x_int8 @ weight.T
    start, end = QUANT_BYTES[name]
    zero = blocks.reshape(blocks.shape[0], -1, gguf.GGML_QUANT_SIZES[T[name]][1]).copy()
    zero[..., start:end] = 0
    at_zero = dequantized(name, zero.reshape(blocks.shape)).double()
    return x_int8 @ (weight - at_zero).T + x.double() @ at_zero.T


@pytest.fixture(scope="module", params=TYPES)
def layer(request, ops):
    """(type name, file blocks, gguf-py's float32 weight, repacked blocks) of one 37 x 512 layer."""
    name = request.param
    blocks = make_blocks(name)
    return name, blocks, dequantized(name, blocks), ops.repack_blocks(torch.from_numpy(blocks), int(T[name]))


def test_repacked_blocks_dequantize_to_ggufs_own_weights(ops, layer):
    name, blocks, weight, packed = layer
    assert torch.isfinite(weight).all() and weight.abs().max() > 0.01
    every = ops.dequantize_rows(packed, int(T[name]), N, torch.arange(N))
    assert torch.equal(every, weight)  # the round trip: file -> our layout -> each weight as gguf-py reads it
    ids = torch.tensor([36, 0, 7, 8, 36, 21])  # the last (partial) group, a group's edges, a repeat
    assert torch.equal(ops.dequantize_rows(packed, int(T[name]), N, ids), weight[ids])
    assert ops.dequantize_rows(packed, int(T[name]), N, torch.zeros(0, dtype=torch.long)).shape == (0, K)
    # about the file's bytes a weight: the kernels read one copy, not a widened one
    assert packed.nbytes <= blocks.nbytes * 40 / 37 * 1.04, packed.nbytes / blocks.nbytes


def file_fields(name: str, b: np.ndarray):
    """Blocks b uint8 [n, nb, type size] as GGUF defines them -> (unsigned quants [n, nb, inputs], float16 d (and
    m / dmin) bytes [n, nb, 2 or 4], the small scale rows [n, nb, 16] or None), one field at a time."""
    w, i = np.arange(256), np.arange(16)
    crumbs = lambda qs: (qs[..., w // 128 * 32 + w % 32] >> (w % 128 // 32 * 2)) & 3
    high = lambda h: (h[..., w % 32] >> (w // 32)) & 1
    if name == "Q8_0":
        return b[..., 2:34], b[..., :2], None
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        heads = 2 if name.endswith("0") else 4
        qs = b[..., heads + 4 * name.startswith("Q5"):][..., :16]
        u = np.concatenate([qs & 15, qs >> 4], -1)
        if name.startswith("Q5"):
            qh = b[..., heads:heads + 4].copy().view("<u4")
            u = u | ((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4
        return u, b[..., :heads], None
    if name == "Q2_K":
        return crumbs(b[..., 16:80]), b[..., 80:84], b[..., :16]
    if name == "Q3_K":
        s = b[..., 96:108]
        sc = ((s[..., i % 8] >> (i // 8 * 4)) & 15) | ((s[..., 8 + i % 4] >> (i // 4 * 2)) & 3) << 4
        return crumbs(b[..., 32:96]) | high(b[..., :32]) << 2, b[..., 108:110], (sc.astype(np.int64) - 32) % 256
    if name == "Q6_K":
        low = (b[..., w // 128 * 64 + w % 64] >> (w % 128 // 64 * 4)) & 15
        return low | crumbs(b[..., 128:192]) << 4, b[..., 208:210], b[..., 192:208]
    s, j = b[..., 4:16], np.arange(4)  # Q4_K, Q5_K: 6-bit scales (rows 0-7) and mins (rows 8-15)
    sc = np.concatenate([s[..., j] & 63, (s[..., 8 + j] & 15) | (s[..., j] >> 6) << 4,
                         s[..., 4 + j] & 63, (s[..., 8 + j] >> 4) | (s[..., 4 + j] >> 6) << 4], -1)
    qs = b[..., 16:144] if name == "Q4_K" else b[..., 48:176]
    u = (qs[..., w // 64 * 32 + w % 32] >> (w // 32 % 2 * 4)) & 15
    return (u | high(b[..., 16:48]) << 4 if name == "Q5_K" else u), b[..., :4], sc


def reference_layout(name: str, blocks: np.ndarray) -> np.ndarray:
    """The group blocks of quant_types.h's layout comment, built field by field from the file's: d (and m) of 8
    columns, their scale rows, then per block of 32 inputs the planes of u (quad q: inputs 4q..4q+3)."""
    bits = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q2_K": 2, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5,
            "Q6_K": 6}[name]
    n, type_size = blocks.shape[0], gguf.GGML_QUANT_SIZES[T[name]][1]
    fields = file_fields(name, blocks.reshape(n, -1, type_size))
    groups, nb = -(-n // 8), blocks.shape[1] // type_size
    padded = [None if f is None else np.concatenate([np.asarray(f, np.uint8), np.zeros(
        (groups * 8 - n, *f.shape[1:]), np.uint8)]).reshape(groups, 8, nb, -1) for f in fields]  # [g, c, nb, ...]
    u, heads, scales = padded
    parts = [heads.reshape(groups, 8, nb, -1, 2).transpose(0, 2, 3, 1, 4).reshape(groups, nb, -1)]
    if scales is not None:
        parts.append(scales.transpose(0, 2, 3, 1).reshape(groups, nb, -1))
    q = u.reshape(groups, 8, nb, -1, 8, 4).transpose(4, 0, 2, 3, 1, 5)  # [quad, g, nb, block, column, input]
    if bits == 8:
        planes = list(q)
    elif bits >= 4:
        planes = [(q[p] & 15) | (q[p + 4] & 15) << 4 for p in range(4)]
        if bits == 5:
            planes.append(sum((q[k] >> 4 & 1) << k for k in range(8)))
        if bits == 6:
            planes += [sum((q[2 * k + r] >> 4 & 3) << 2 * k for k in range(4)) for r in range(2)]
    else:
        planes = [sum((q[2 * k + r] & 3) << 2 * k for k in range(4)) for r in range(2)]
        if bits == 3:
            planes.append(sum((q[k] >> 2 & 1) << k for k in range(8)))
    parts.append(np.stack(planes, 3).reshape(groups, nb, -1))
    return np.concatenate(parts, -1).astype(np.uint8)


@pytest.mark.parametrize("name", TYPES)
def test_repack_is_the_layout_byte_for_byte(ops, name):
    """Every bit pattern of a block (random bytes), whole and partial groups: the layout, written out in numpy."""
    rng = np.random.default_rng(7)
    block_size, type_size = gguf.GGML_QUANT_SIZES[T[name]]
    for n, k in ((N, K), (1, 256), (16, 768), (131, 1024)):
        blocks = rng.integers(0, 256, (n, k // block_size * type_size), dtype=np.uint8)
        packed = ops.repack_blocks(torch.from_numpy(blocks), int(T[name])).numpy()
        expected = reference_layout(name, blocks)
        assert packed.shape == expected.shape and np.array_equal(packed, expected), (n, k)


@pytest.mark.parametrize("name", TYPES)
def test_parts_repack_as_their_concatenation_byte_for_byte(ops, name):
    """Several layers' blocks repacked from where each lies (`fused`: no concatenated copy) are the bytes of their
    concatenation repacked, with groups of 8 rows straddling parts; a strided part is read as its rows."""
    rng = np.random.default_rng(11)
    block_size, type_size = gguf.GGML_QUANT_SIZES[T[name]]
    row_bytes = 512 // block_size * type_size
    parts = [rng.integers(0, 256, (n, row_bytes), dtype=np.uint8) for n in (13, 8, 27)]
    expected = ops.repack_blocks(torch.from_numpy(np.concatenate(parts)), int(T[name]))
    assert torch.equal(ops.repack_block_parts([torch.from_numpy(p) for p in parts], int(T[name])), expected)
    wide = rng.integers(0, 256, (13, 2 * row_bytes), dtype=np.uint8)[:, :row_bytes]  # rows 2 row sizes apart
    assert torch.equal(ops.repack_block_parts([torch.from_numpy(wide), torch.from_numpy(parts[1])], int(T[name])),
                       ops.repack_blocks(torch.from_numpy(np.concatenate([wide, parts[1]])), int(T[name])))
    with pytest.raises(RuntimeError, match="one row size"):
        ops.repack_block_parts([torch.from_numpy(parts[0]), torch.from_numpy(parts[0][:, :type_size])], int(T[name]))


def test_an_id_outside_the_weight_is_refused(ops, layer):
    name, _, _, packed = layer
    with pytest.raises(RuntimeError, match="is not a row"):
        ops.dequantize_rows(packed, int(T[name]), N, torch.tensor([N]))


def test_prompt_rows_are_float32_panels_over_the_dequantized_weight_bit_for_bit(ops, layer):
    name, _, weight, packed = layer
    panels = ops.pack_linear_weight(weight, torch.float32)
    bias = torch.randn(N)
    torch.manual_seed(1)
    for rows in ROWS:
        x = torch.randn(rows, K)
        got = ops.quant_linear(x, packed, int(T[name]), N, None, 0)
        assert torch.equal(got, ops.linear(x, panels, N)), rows
        with_bias = ops.quant_linear(x, packed, int(T[name]), N, bias, 0)
        torch.testing.assert_close(with_bias, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_prompt_rows_in_bfloat16_are_the_dot_product_panels_over_the_dequantized_weight(ops, layer):
    """`dot` (the engine's choice where the build has bfloat16 dot products): bit for bit what the bfloat16
    dot-product panels of the dequantized weight give, and a row the same alone and in any batch."""
    if not ops.bf16_dot:
        pytest.skip("this build has no bfloat16 dot products")
    name, _, weight, packed = layer
    panels = ops.pack_linear_weight(weight, torch.bfloat16, dot=True)
    torch.manual_seed(5)
    x = torch.randn(max(ROWS), K)
    alone = ops.quant_linear(x[:1], packed, int(T[name]), N, None, 0, True)
    for rows in ROWS:
        got = ops.quant_linear(x[:rows], packed, int(T[name]), N, None, 0, True)
        assert torch.equal(got, ops.linear(x[:rows], panels, N)), rows
        assert torch.equal(got[:1], alone), rows


def test_decode_rows_compute_the_integer_arithmetic_they_promise(ops, layer):
    name, blocks, weight, packed = layer
    torch.manual_seed(2)
    bias = torch.randn(N)
    for rows in ROWS:
        x = torch.randn(rows, K) * torch.linspace(0.1, 4, K)  # uneven magnitudes, as real activations
        got = ops.quant_linear(x, packed, int(T[name]), N, bias)
        ref = integer_reference(name, blocks, x) + bias.double()
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        # against the float weights, the only error is the activations' int8 rounding: under 2% of the norm
        exact = torch.nn.functional.linear(x, weight, bias)
        assert ((got - exact).norm() / exact.norm()).item() < 0.02, rows


def test_a_row_is_the_same_alone_and_in_any_batch_on_both_roads(ops, layer):
    name, _, _, packed = layer
    torch.manual_seed(3)
    x = torch.randn(max(ROWS), K)
    for float_from in (-1, 0):
        alone = ops.quant_linear(x[:1], packed, int(T[name]), N, None, float_from)
        for rows in ROWS:
            assert torch.equal(ops.quant_linear(x[:rows], packed, int(T[name]), N, None, float_from)[:1], alone)
    mixed = ops.quant_linear(x[:13], packed, int(T[name]), N, None, 5)  # 5 decode rows, then 8 prompt rows
    assert torch.equal(mixed[:5], ops.quant_linear(x[:5], packed, int(T[name]), N, None, -1))
    assert torch.equal(mixed[5:], ops.quant_linear(x[5:13], packed, int(T[name]), N, None, 0))


def test_k_quants_need_whole_super_blocks(ops):
    blocks = make_blocks("Q4_K")
    packed = ops.repack_blocks(torch.from_numpy(blocks), int(T.Q4_K))
    with pytest.raises(RuntimeError, match="do not match"):
        ops.quant_linear(torch.randn(1, K - 32), packed, int(T.Q4_K), N)
    with pytest.raises(RuntimeError, match="qtype"):
        ops.repack_blocks(torch.from_numpy(blocks), int(T.IQ4_NL))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q5_0"])
def test_engine_linear_serves_and_stacks_each_type(ops, name):
    """EngineLinear over a type's blocks, its rows() the embedding lookup, and fused() layers of one type."""
    first, second = make_blocks(name, 24, K, seed=4), make_blocks(name, 13, K, seed=5)
    layers = [torch.nn.Linear(K, 24), torch.nn.Linear(K, 13)]
    weights = [QuantizedWeight(b, int(T[name]), name) for b in (first, second)]
    linear = EngineLinear(layers[0], ops, "gguf", weights[0])
    ids = torch.tensor([3, 23, 3])
    assert torch.equal(linear.rows(ids), dequantized(name, first)[ids])
    both = fused(layers, ops, "gguf", weights)
    x = torch.randn(3, K)
    with torch.inference_mode():
        alone = torch.cat([EngineLinear(la, ops, "gguf", w)(x) for la, w in zip(layers, weights)], dim=1)
        assert torch.equal(both(x), alone)
        assert torch.equal(both(x, 0), torch.cat([EngineLinear(la, ops, "gguf", w)(x, 0)
                                                  for la, w in zip(layers, weights)], dim=1))
    assert torch.equal(both.rows(torch.tensor([30])), dequantized(name, second)[[30 - 24]])


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "torch"])
def test_rows_of_the_other_formats_are_their_held_weights(ops, fmt):
    torch.manual_seed(6)
    layer = torch.nn.Linear(64, 40)
    linear = EngineLinear(layer, None if fmt == "torch" else ops, "float32" if fmt == "torch" else fmt)
    ids = torch.tensor([39, 0, 17])
    weight = layer.weight.detach()
    expected = {"float32": weight, "bfloat16": weight.to(torch.bfloat16).float(), "torch": weight,
                "int8": dequantized("Q8_0", ops.quantize_q8_0(weight).numpy())}[fmt]
    assert torch.equal(linear.rows(ids), expected[ids])
