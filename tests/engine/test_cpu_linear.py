"""Engine linear layers: as accurate as F.linear, the same per row whatever the batch, one row untouched, and
the caller's model never changed (the packed copy belongs to the engine's backend)."""

import pytest

torch = pytest.importorskip("torch")

from tfserve.engine import cpu_linear, kernels  # noqa: E402
from tfserve.engine.cpu_linear import EngineLinear  # noqa: E402

ROWS = (1, 2, 7, 14, 15, 32, 100)


class TorchPanels:
    """The kernels' packing contract in torch, to test EngineLinear's own logic on any CPU."""

    calls = 0

    @staticmethod
    def pack_linear_weight(weight):
        return weight.clone()

    @classmethod
    def linear(cls, x, panels, out_features, bias=None):
        cls.calls += 1
        assert panels.shape[0] == out_features
        return torch.nn.functional.linear(x, panels, bias)


@pytest.fixture
def layers():
    torch.manual_seed(0)
    # 100 output features: not a whole number of 32-column panels, so the kernel's tail is exercised
    return torch.nn.Linear(64, 100), torch.nn.Linear(100, 40, bias=False)


def test_one_row_keeps_f_linear_bit_for_bit_and_more_rows_use_the_kernel(layers):
    TorchPanels.calls = 0
    for layer in layers:
        linear = EngineLinear(layer, TorchPanels)
        x = torch.randn(1, layer.in_features)
        with torch.inference_mode():
            assert torch.equal(linear(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
            assert TorchPanels.calls == 0
            torch.testing.assert_close(linear(torch.randn(5, layer.in_features)).shape, torch.Size([5, layer.out_features]))
        TorchPanels.calls = 0


def test_without_panels_every_row_count_is_f_linear(layers):
    layer = layers[0]
    linear = EngineLinear(layer)
    for rows in ROWS:
        x = torch.randn(rows, 64)
        with torch.inference_mode():
            assert torch.equal(linear(x), torch.nn.functional.linear(x, layer.weight, layer.bias)), rows


def test_the_callers_layers_are_untouched(layers):
    layer = layers[0]
    before = layer.weight.detach().clone()
    EngineLinear(layer, TorchPanels)
    assert "forward" not in vars(layer) and not [name for name in vars(layer) if name.startswith("_tfserve")]
    assert torch.equal(layer.weight, before)


@pytest.fixture
def ops():
    ops = kernels.cpu_ops()
    if ops is None or not hasattr(ops, "linear"):
        pytest.skip(f"the packed linear kernel is AVX-512 only; this CPU's kernels are {kernels.isa()}")
    return ops


def test_kernel_agrees_with_f_linear(layers, ops):
    for layer in layers:
        linear = EngineLinear(layer, ops)
        for rows in ROWS:
            x = torch.randn(rows, layer.in_features)
            with torch.inference_mode():
                torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, layer.weight, layer.bias),
                                           rtol=1e-5, atol=1e-5)


def test_kernel_gives_a_row_the_same_bits_in_any_batch(layers, ops):
    linear = EngineLinear(layers[0], ops)
    rows = torch.randn(40, 64)
    with torch.inference_mode():
        alone = linear(rows[:2])
        for batch in (3, 14, 15, 29, 40):
            assert torch.equal(linear(rows[:batch])[:2], alone), batch


def test_can_pack_needs_the_kernel_and_float32(layers):
    model = torch.nn.Sequential(*layers)
    assert not cpu_linear.can_pack(model, None)
    assert cpu_linear.can_pack(model, TorchPanels)
    assert not cpu_linear.can_pack(model.to(torch.bfloat16), TorchPanels)
