"""Compressors without a process group: round trips, exact top-K, threshold, error feedback."""

from __future__ import annotations

import math

import pytest
import torch

from troupe.compress import (
    COMPRESSORS,
    ErrorFeedback,
    HalfCompressor,
    NoCompression,
    ThresholdCompressor,
    TopKCompressor,
    make_compressor,
    topk_count,
)
from troupe.strategies.partial import plan_chunks
from troupe.strategies.compressed import CompressionConfig


def grad(n=1000, seed=0, scale=1.0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


def roundtrip(c, g, name="g"):
    payload, ctx = c.compress(g, name)
    return payload, c.decompress(payload, ctx)


def test_none_roundtrip_is_exact():
    g = grad().view(10, 100)
    _, out = roundtrip(NoCompression(), g)
    assert torch.equal(out, g)


@pytest.mark.parametrize("dtype,eps", [("fp16", 2**-11), ("bf16", 2**-8)])
def test_half_roundtrip_within_precision(dtype, eps):
    g = grad(scale=3.0).view(20, 50)
    payload, out = roundtrip(HalfCompressor(dtype), g)
    assert payload[0].dtype == {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    assert payload[0].numel() == g.numel()
    assert out.shape == g.shape and out.dtype == torch.float32
    assert torch.all((out - g).abs() <= eps * g.abs() + 1e-7)


def test_half_scale_divides_before_the_cast_and_clip_limits():
    g = torch.tensor([1e5, -2e5, 3.0, 0.5])  # 1e5 overflows fp16 unless scaled first
    assert torch.isinf(HalfCompressor("fp16").compress(g, "g")[0][0]).any()
    payload, out = roundtrip(HalfCompressor("fp16", scale=1 / 4), g)
    assert torch.isfinite(payload[0]).all()
    torch.testing.assert_close(out, g, rtol=1e-3, atol=0)
    _, clipped = roundtrip(HalfCompressor("fp16", clip_value=100), g)
    assert clipped.tolist() == [100.0, -100.0, 3.0, 0.5]


def test_half_rejects_bad_input():
    with pytest.raises(ValueError, match="fp8"):
        HalfCompressor("fp8")
    with pytest.raises(ValueError, match="clip_value"):
        HalfCompressor("fp16", clip_value=-1)
    with pytest.raises(ValueError, match="float64"):
        HalfCompressor("fp16").compress(torch.zeros(3, dtype=torch.float64), "w")


@pytest.mark.parametrize("spars", [0.01, 0.07, 0.5, 1.0])
def test_topk_is_exact_against_a_sort(spars):
    g = grad(1000, seed=3)
    payload, out = roundtrip(TopKCompressor(spars), g)
    k = math.ceil(round(spars * 1000, 9))
    index, values = payload
    assert index.dtype == torch.int32 and index.numel() == values.numel() == k
    assert torch.equal(values, g[index.long()])
    # the k selected magnitudes are the k largest (ties are impossible with random floats)
    expected = g.abs().sort(descending=True).values[:k]
    assert torch.equal(values.abs().sort(descending=True).values, expected)
    # unselected elements are zero, selected ones exact
    mask = torch.zeros(1000, dtype=torch.bool)
    mask[index.long()] = True
    assert torch.equal(out[mask], g[mask]) and not out[~mask].any()


def test_topk_true_magnitudes_below_one():
    # SINGA truncates magnitudes to integers; all of these would tie at 0 there.
    g = torch.tensor([0.1, -0.9, 0.5, 0.3, -0.2, 0.05, 0.7, 0.0, 0.6, -0.4])
    index, _ = TopKCompressor(0.3).compress(g, "g")[0]
    assert sorted(index.tolist()) == [1, 6, 8]


def test_topk_count_and_bad_spars():
    assert topk_count(0.07, 100) == 7
    assert topk_count(0.01, 431080) == 4311
    assert topk_count(1e-9, 10) == 1
    assert topk_count(0.5, 0) == 0
    for bad in (0, -0.1, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match=repr(bad)):
            TopKCompressor(bad)


def test_threshold_selects_at_or_above_and_may_select_nothing():
    g = torch.tensor([0.5, -0.01, 0.02, -0.5, 0.019999])
    payload, out = roundtrip(ThresholdCompressor(0.02), g)
    assert payload[0].tolist() == [0, 2, 3]
    assert torch.equal(out, torch.tensor([0.5, 0.0, 0.02, -0.5, 0.0]))
    payload, out = roundtrip(ThresholdCompressor(10.0), g)
    assert payload[0].numel() == 0 and payload[1].numel() == 0 and not out.any()
    _, out = roundtrip(ThresholdCompressor(0), g)
    assert torch.equal(out, g)
    for bad in (-1e-3, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="threshold"):
            ThresholdCompressor(bad)


@pytest.mark.parametrize("inner", [TopKCompressor(0.1), ThresholdCompressor(1.0), HalfCompressor("fp16")])
def test_error_feedback_invariant(inner):
    ef = ErrorFeedback(inner)
    old = torch.zeros(500)
    for step in range(4):
        g = grad(500, seed=10 + step)
        payload, ctx = ef.compress(g, "bucket0")
        sent = ef.decompress(payload, ctx)
        new = ef.residuals["bucket0"]
        torch.testing.assert_close(sent + new, g + old, rtol=0, atol=1e-6)
        old = new.clone()
    assert ef.residual_norm() == pytest.approx(float(old.norm()), rel=1e-6)


def test_error_feedback_eventually_sends_everything():
    # A constant gradient under top-K 10%: the residual grows where nothing is sent
    # until it wins; within 60 steps every element is sent at least once.
    ef = ErrorFeedback(TopKCompressor(0.1))
    g = torch.linspace(0.1, 1.0, 100)
    sent_total = torch.zeros(100)
    for _ in range(60):
        payload, ctx = ef.compress(g, "b")
        sent_total += ef.decompress(payload, ctx)
    assert (sent_total > 0).all()
    torch.testing.assert_close(sent_total + ef.residuals["b"], 60 * g)


def test_error_feedback_shape_mismatch_is_reported():
    ef = ErrorFeedback(TopKCompressor(0.5), {"bucket0": torch.zeros(3)})
    with pytest.raises(ValueError, match="bucket0"):
        ef.compress(torch.ones(4), "bucket0")


def test_registry():
    assert set(COMPRESSORS) == {"none", "fp16", "bf16", "topk", "threshold"}
    assert make_compressor("bf16").dtype == torch.bfloat16
    assert make_compressor("topk", spars=0.2).spars == 0.2
    with pytest.raises(ValueError, match=r"'zip'.*bf16.*fp16.*none.*threshold.*topk"):
        make_compressor("zip")


def test_plan_chunks_cuts_in_backward_order_into_equal_chunks():
    params = [torch.zeros(5), torch.zeros(3, 4), torch.zeros(2)]
    chunks = plan_chunks(params, 6)
    sizes = [sum(p.stop - p.start for p in c) for c in chunks]
    assert sizes == [6, 6, 6, 1]
    order = [(p.param, p.start, p.stop) for c in chunks for p in c]
    assert order == [(2, 0, 2), (1, 0, 4), (1, 4, 10), (1, 10, 12), (0, 0, 4), (0, 4, 5)]
    with pytest.raises(ValueError, match="chunk_size"):
        plan_chunks(params, 0)


def test_compression_config_validation():
    with pytest.raises(ValueError, match="warmup_steps.*-1"):
        CompressionConfig(warmup_steps=-1)
    with pytest.raises(ValueError, match="chunk_size"):
        CompressionConfig(chunk_size=1.5)


@pytest.mark.parametrize("case", ["random", "constant", "hidden_peaks", "heavy_tail"])
@pytest.mark.parametrize("k", [1, 431, 4311])
def test_topk_indices_matches_a_full_sort(case, k):
    from troupe.compress.topk import topk_indices

    n = 431080
    g = torch.Generator().manual_seed(k)
    if case == "random":
        x = torch.randn(n, generator=g).abs()
    elif case == "constant":
        x = torch.ones(n)
    elif case == "hidden_peaks":  # the large values avoid the strided sample: the fallback must catch it
        x = torch.rand(n, generator=g) * 1e-3
        x[1::52] = 1.0 + torch.rand(x[1::52].shape, generator=g)
    else:
        x = torch.randn(n, generator=g).abs() ** 6
    index = topk_indices(x, k)
    assert index.numel() == k and index.unique().numel() == k
    assert torch.equal(x[index].sort(descending=True).values, x.sort(descending=True).values[:k])


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))],
)
def test_codecs_keep_the_device(device):
    g = grad(70000, seed=5).to(device)
    for c in (HalfCompressor("fp16"), HalfCompressor("bf16"), TopKCompressor(0.01), ThresholdCompressor(2.0)):
        payload, out = roundtrip(ErrorFeedback(c), g)
        assert out.device.type == device and all(t.device.type == device for t in payload)
    index, values = TopKCompressor(0.01).compress(g, "g")[0]
    assert torch.equal(values.abs().sort().values, g.abs().sort().values[-index.numel() :])


def test_half_scale_given_as_a_callable_is_read_at_each_call():
    """An elastic job's group changes size between steps: fp16 divides by the size of this step."""
    size = [4]
    c = HalfCompressor("fp16", scale=lambda: 1 / size[0])
    g = torch.full((8,), 40000.0)
    assert torch.equal(c.compress(g, "g")[0][0].float(), torch.full((8,), 10000.0))
    size[0] = 2
    payload, ctx = c.compress(g, "g")
    assert torch.equal(payload[0].float(), torch.full((8,), 20000.0))
    assert torch.equal(c.decompress(payload, ctx), g)
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        HalfCompressor("fp16", scale=0)
