import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from fedsight.functional.aggregate import normalize_weights, weighted_mean, weighted_mean_state

finite = st.floats(-1e3, 1e3, allow_nan=False, width=64)


@st.composite
def clients(draw, min_k=1, max_k=6):
    k = draw(st.integers(min_k, max_k))
    shape = draw(st.sampled_from([(3,), (2, 2), (1, 2, 3)]))
    tensors = [torch.from_numpy(draw(arrays(np.float64, shape, elements=finite))) for _ in range(k)]
    weights = draw(st.lists(st.floats(0.01, 100.0), min_size=k, max_size=k))
    return tensors, weights


@given(clients(), st.randoms(use_true_random=False))
def test_invariant_to_client_order(data, rnd):
    tensors, weights = data
    order = list(range(len(tensors)))
    rnd.shuffle(order)
    a = weighted_mean(tensors, weights)
    b = weighted_mean([tensors[i] for i in order], [weights[i] for i in order])
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-9)


@given(clients(), st.floats(1e-3, 1e3))
def test_invariant_to_scaling_all_weights(data, c):
    tensors, weights = data
    torch.testing.assert_close(weighted_mean(tensors, weights), weighted_mean(tensors, [c * w for w in weights]), rtol=1e-12, atol=1e-9)


@given(clients(), st.data())
def test_zero_weight_client_changes_nothing(data, d):
    tensors, weights = data
    extra = torch.from_numpy(d.draw(arrays(np.float64, tuple(tensors[0].shape), elements=finite)))
    torch.testing.assert_close(weighted_mean(tensors, weights), weighted_mean(tensors + [extra], weights + [0.0]), rtol=1e-12, atol=1e-9)


@given(clients())
def test_matches_numpy_average(data):
    tensors, weights = data
    ref = np.average(np.stack([t.numpy() for t in tensors]), axis=0, weights=np.asarray(weights))
    np.testing.assert_allclose(weighted_mean(tensors, weights).numpy(), ref, rtol=1e-10, atol=1e-9)


@settings(max_examples=25)
@given(clients())
def test_state_version_is_keywise(data):
    tensors, weights = data
    states = [{"a": t, "b": 2 * t} for t in tensors]
    out = weighted_mean_state(states, weights)
    torch.testing.assert_close(out["b"], 2 * weighted_mean(tensors, weights))


def test_dtype_and_inputs_preserved():
    ts = [torch.ones(3, dtype=torch.float32), torch.zeros(3, dtype=torch.float32)]
    before = [t.clone() for t in ts]
    out = weighted_mean(ts, [1, 3])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.full((3,), 0.25))
    for t, b in zip(ts, before):
        assert torch.equal(t, b)
    ints = weighted_mean([torch.tensor(10), torch.tensor(13)], [1, 1])
    assert ints.dtype == torch.int64 and int(ints) == 12  # 11.5 rounds half to even


@pytest.mark.parametrize("bad", [[0.0, 0.0], [-1.0, 2.0], [float("nan"), 1.0], []])
def test_bad_weights_rejected(bad):
    with pytest.raises(ValueError):
        normalize_weights(bad)


def test_mismatched_state_keys_rejected():
    with pytest.raises(ValueError, match="keys"):
        weighted_mean_state([{"a": torch.ones(1)}, {"b": torch.ones(1)}], [1, 1])


@given(st.lists(st.sampled_from([0.0, 1.0, -3e38, 3e38, 6e4, float("nan"), float("inf"), -float("inf")]), min_size=1,
                max_size=8),
       st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
       st.sampled_from([torch.float32, torch.float64]))
def test_all_finite_matches_elementwise_check_even_when_sums_overflow(values, dtype, other):
    """Against numpy's element-wise check, whatever the dtypes (a half-precision tensor, whose own sums overflow
    at 65504, next to a float32 or a float64 one)."""
    from fedsight.functional.aggregate import all_finite

    t = torch.tensor(values, dtype=torch.float64).to(dtype)
    assert all_finite({"a": t, "b": torch.ones(2, dtype=other)}) == bool(np.isfinite(t.double().numpy()).all())


@given(st.integers(1, 5), st.data(),
       st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64]),
       st.sampled_from([torch.float32, torch.float64]))
def test_finite_rows_passes_no_row_holding_a_non_finite_value(n, data, dtype, other):
    """Against numpy's element-wise check of each row of two stacks: a row with a NaN or an infinity in either is
    never proven finite, whatever the dtypes; a finite row whose sums cannot overflow (values of magnitude <= 1)
    always is; an integer stack (batch counts) is finite."""
    from fedsight.functional.aggregate import finite_rows

    values = st.sampled_from([0.0, 1.0, -1.0, -3e38, 3e38, 6e4, float("nan"), float("inf"), -float("inf")])
    a = torch.tensor(data.draw(st.lists(st.lists(values, min_size=3, max_size=3), min_size=n, max_size=n)),
                     dtype=torch.float64).to(dtype)
    b = torch.tensor(data.draw(st.lists(st.lists(values, min_size=2, max_size=2), min_size=n, max_size=n)),
                     dtype=torch.float64).to(other).view(n, 1, 2)
    counts = torch.arange(n)
    got = finite_rows([a, b, counts]).numpy()
    an, bn = a.numpy() if dtype == torch.complex64 else a.double().numpy(), b.numpy()
    truth = np.isfinite(an).all(1) & np.isfinite(bn).all((1, 2))
    small = (np.abs(an) <= 1).all(1) & (np.abs(bn) <= 1).all((1, 2))
    assert got.shape == (n,)
    assert not (got & ~truth).any()
    assert got[truth & small].all()


@given(st.lists(st.tuples(*[st.sampled_from([0.0, 1.0, -3e38, 3e38, float("nan"), float("inf"), -float("inf")])] * 2),
                min_size=1, max_size=6),
       st.sampled_from([torch.complex64, torch.complex128]))
def test_all_finite_reads_both_parts_of_complex_tensors(parts, dtype):
    """A complex tensor is finite when both parts of every element are (numpy's element-wise check), next to a real
    one: the in-process runtime's check that spares the server a second pass (``Reply.finite_checked``) must cover
    every tensor the server's contract would check, complex extras included."""
    from fedsight.functional.aggregate import all_finite

    t = torch.tensor([complex(a, b) for a, b in parts], dtype=torch.complex128).to(dtype)
    assert all_finite({"a": torch.ones(3), "b": t}) == bool(np.isfinite(t.numpy()).all())
