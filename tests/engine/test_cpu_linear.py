"""Panel-packed linear layers: as accurate as F.linear, the same per row whatever the batch, one row untouched."""

import pytest

torch = pytest.importorskip("torch")

from tfserve.engine import cpu_linear  # noqa: E402


@pytest.fixture
def model():
    torch.manual_seed(0)
    # 100 output features: not a whole number of 32-column panels, so the tail is exercised
    model = torch.nn.Sequential(torch.nn.Linear(64, 100), torch.nn.ReLU(), torch.nn.Linear(100, 40, bias=False))
    if not cpu_linear.can_pack(model):
        pytest.skip("the packed kernel needs the CPU extension with AVX-512")
    return model


def test_packed_layers_agree_with_f_linear_and_leave_other_modules_alone(model):
    inputs = {rows: torch.randn(1, rows, 64) for rows in (1, 2, 7, 14, 15, 32, 100)}
    with torch.inference_mode():
        expected = {rows: model(x) for rows, x in inputs.items()}
        assert cpu_linear.pack_linear_weights(model) == 2
        for rows, x in inputs.items():
            got = model(x)
            assert got.shape == expected[rows].shape
            torch.testing.assert_close(got, expected[rows], rtol=1e-5, atol=1e-5)
        assert torch.equal(model(inputs[1]), expected[1])  # one row keeps F.linear, bit for bit
    assert not hasattr(model[1], "_tfserve_panels")


def test_a_row_gets_the_same_bits_in_any_batch(model):
    cpu_linear.pack_linear_weights(model)
    rows = torch.randn(40, 64)
    with torch.inference_mode():
        alone = model(rows[:2])
        for batch in (3, 14, 15, 29, 40):
            assert torch.equal(model(rows[:batch])[:2], alone), batch


def test_training_keeps_f_linear(model):
    cpu_linear.pack_linear_weights(model)
    x = torch.randn(4, 64, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None
