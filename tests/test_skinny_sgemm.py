"""The sgemm router's few-row kernel (scripts/blas/skinny_sgemm.c).

The kernel is called directly through ctypes (correctness against float64 numpy at
every blocking edge, alpha/beta, strides, threads), and through MLX when the router is
preloaded (the benchmark's setup): a row's product must have the same bits whatever
the number of rows, which is what makes verifying a tree give each token exactly the
products it gets when decoded alone.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

ROUTER = Path(__file__).resolve().parents[1] / ".venv" / "lib" / "libsgemm_router.so"
PRELOADED = "libsgemm_router.so" in os.environ.get("LD_PRELOAD", "")
FLOAT_POINTER = ctypes.POINTER(ctypes.c_float)

needs_router = pytest.mark.skipif(
    not ROUTER.is_file(), reason=f"no sgemm router at {ROUTER} (scripts/setup builds it with gcc)"
)


@pytest.fixture(scope="module")
def kernel():
    library = ctypes.CDLL(str(ROUTER))
    if not library.skinny_sgemm_available():
        pytest.skip("this CPU has neither AVX-512F nor AVX2+FMA: the router never uses the kernel")
    library.skinny_sgemm.argtypes = [ctypes.c_int] * 3 + [
        ctypes.c_float,
        FLOAT_POINTER,
        ctypes.c_int,
        FLOAT_POINTER,
        ctypes.c_int,
        ctypes.c_float,
        FLOAT_POINTER,
        ctypes.c_int,
    ]
    threads = library.skinny_sgemm_threads()
    yield library
    library.skinny_sgemm_configure(threads, -1)
    library.skinny_sgemm_select(BEST)


# Vector units (skinny_sgemm.h): each test runs on every one this CPU has.
BEST, AVX2, AVX512 = 0, 1, 2


@pytest.fixture(params=[AVX2, AVX512], ids=["avx2", "avx512"])
def isa(request, kernel):
    if not kernel.skinny_sgemm_select(request.param):
        pytest.skip("this CPU has no " + ("AVX2+FMA" if request.param == AVX2 else "AVX-512F"))
    return request.param  # the kernel fixture selects the best unit again afterwards


def multiply(kernel, x, w, alpha=1.0, beta=0.0, c=None):
    """C = alpha * x @ w.T + beta * C through the kernel; x, w, c may be strided row views."""
    m, k = x.shape
    n = w.shape[0]
    if c is None:
        c = np.full((m, n), np.nan, dtype=np.float32)
    for array in (x, w, c):
        assert array.strides[1] == 4
    kernel.skinny_sgemm(
        m,
        n,
        k,
        alpha,
        x.ctypes.data_as(FLOAT_POINTER),
        x.strides[0] // 4,
        w.ctypes.data_as(FLOAT_POINTER),
        w.strides[0] // 4,
        beta,
        c.ctypes.data_as(FLOAT_POINTER),
        c.strides[0] // 4,
    )
    return c


@needs_router
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_products_match_numpy_at_every_block_edge(kernel, isa, threads):
    kernel.skinny_sgemm_configure(threads, -1)
    rng = np.random.default_rng(threads)
    # n: below, at and past the 2-4 row blocks and the threading threshold (2^17 weights);
    # k: multiples of the vector width and ragged tails.
    for n, k in [(1, 5), (3, 16), (7, 33), (130, 576), (577, 231), (1031, 200)]:
        w = rng.standard_normal((n, k)).astype(np.float32)
        for m in range(1, 17):
            x = rng.standard_normal((m, k)).astype(np.float32)
            expected = x.astype(np.float64) @ w.astype(np.float64).T
            np.testing.assert_allclose(multiply(kernel, x, w), expected, rtol=1e-4, atol=1e-4)


@needs_router
def test_alpha_beta_and_leading_dimensions(kernel, isa):
    rng = np.random.default_rng(0)
    big_x = rng.standard_normal((5, 40)).astype(np.float32)
    big_w = rng.standard_normal((300, 50)).astype(np.float32)
    x, w = big_x[:, 3:35], big_w[::2, 7:39]  # (5, 32) and (150, 32) strided views
    c_big = rng.standard_normal((5, 160)).astype(np.float32)
    before = c_big.copy()
    c = c_big[:, 5:155]
    multiply(kernel, x, w, alpha=0.5, beta=2.0, c=c)
    expected = 0.5 * (x.astype(np.float64) @ w.astype(np.float64).T) + 2.0 * before[:, 5:155]
    np.testing.assert_allclose(c, expected, rtol=1e-4, atol=1e-4)
    # Outside the view nothing changed.
    np.testing.assert_array_equal(c_big[:, :5], before[:, :5])
    np.testing.assert_array_equal(c_big[:, 155:], before[:, 155:])
    # beta == 0 never reads C (NaN there must not leak into the result).
    assert np.isfinite(multiply(kernel, x, w)).all()


@needs_router
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_has_the_same_bits_whatever_the_number_of_rows(kernel, isa, threads):
    kernel.skinny_sgemm_configure(threads, -1)
    rng = np.random.default_rng(1)
    w = rng.standard_normal((1543, 579)).astype(np.float32)
    x = rng.standard_normal((8, 579)).astype(np.float32)
    alone = np.concatenate([multiply(kernel, x[i : i + 1], w) for i in range(8)])
    for m in range(2, 9):
        np.testing.assert_array_equal(multiply(kernel, x[:m], w), alone[:m])


@pytest.mark.skipif(
    not PRELOADED, reason="the sgemm router is not preloaded (source scripts/env.sh first)"
)
def test_mlx_matmuls_through_the_router_are_row_invariant():
    """Under the router, MLX's fp32 linear layers give a token the same bits in a tree."""
    key = mx.random.key(0)
    w = mx.random.normal((1536, 576), key=key)
    x = mx.random.normal((1, 8, 576), key=mx.random.split(key)[0])  # (B, N, D)
    together = np.array(x @ w.T)  # (B, N, 1536)
    for i in range(8):
        np.testing.assert_array_equal(np.array(x[:, i : i + 1] @ w.T)[0, 0], together[0, i])
    expected = np.array(x, dtype=np.float64) @ np.array(w, dtype=np.float64).T
    np.testing.assert_allclose(together, expected, rtol=1e-4, atol=1e-3)
