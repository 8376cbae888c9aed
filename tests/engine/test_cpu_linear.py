"""MKL-packed weights: which batch sizes get them, and results bit-identical to F.linear."""

import pytest

torch = pytest.importorskip("torch")

from tfserve.engine import cpu_linear  # noqa: E402


def test_packed_row_counts_fit_the_budget():
    assert cpu_linear.packed_row_counts(64, 10**6) == [64, 32, 16]
    assert cpu_linear.packed_row_counts(48, 10**6) == [48, 32, 16]
    assert cpu_linear.packed_row_counts(8, 10**6) == []  # below 16 rows MKL's packed path is not bit-identical
    assert cpu_linear.packed_row_counts(64, cpu_linear.MAX_PACKED_BYTES // 2) == [64, 32]


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="needs MKL")
def test_packed_forward_is_bit_identical_and_leaves_other_layers_alone():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32, bias=False))
    inputs = {rows: torch.randn(1, rows, 64) for rows in (1, 7, 16, 23, 32)}
    with torch.inference_mode():
        expected = {rows: model(x) for rows, x in inputs.items()}
        assert cpu_linear.can_pack(model)
        assert cpu_linear.pack_linear_weights(model, 32) == [32, 16]
        for rows, x in inputs.items():
            assert torch.equal(model(x), expected[rows]), rows
    assert set(model[0]._tfserve_packed) == {32, 16}
    assert not hasattr(model[1], "_tfserve_packed")
