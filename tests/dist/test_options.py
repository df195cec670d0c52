"""The communication-saving dist_options on 3 ranks, against references computed here.

Every rank's loss is ``sum((p * G[rank, step, name]).sum())``, so its gradient is the
chosen tensor G; plain SGD with lr=1 then makes ``p_before - p_after`` exactly the
gradient the option delivered. The references below redo each option's arithmetic on
the known gradients, without troupe.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.dist.world import run_world

WORLD = 3
SHAPES = {"w1": (40,), "w2": (5, 6), "b": (3,)}
NAMES = list(SHAPES)


def G(rank: int, step: int, scenario: int) -> dict[str, torch.Tensor]:
    """The gradient rank `rank` produces at `step`."""
    g = torch.Generator().manual_seed(1000 * scenario + 10 * step + rank)
    out = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    if scenario == 2 and rank == 2:
        out = {n: v * 1e-3 for n, v in out.items()}  # threshold selects nothing on this rank
    if scenario == 3:
        # over the clip value; 3 * 5e4 overflows fp16 (65504) unless divided before the sum
        out["w1"][:4] = torch.tensor([250.0, -300.0, 99.0, 5e4])
    return out


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        for n, s in SHAPES.items():
            self.register_parameter(n, nn.Parameter(torch.randn(s)))
        self.unused = nn.Parameter(torch.zeros(2))  # no rank gives it a gradient

    def loss(self, g):
        return sum((getattr(self, n) * g[n]).sum() for n in NAMES)


def params(model):
    return {n: getattr(model, n).detach().clone() for n in NAMES}


def make(bucket_size=2**19, **config):
    import troupe

    model = Linear()
    opt = troupe.DistOpt(
        torch.optim.SGD(model.parameters(), lr=1.0), bucket_size=bucket_size,
        compression=troupe.CompressionConfig(**config),
    )
    opt.sync_parameters(model)
    return model, opt


def run_steps(rank, scenario, steps, call, **make_kw):
    model, opt = make(**make_kw)
    history, stats = [params(model)], []
    for step in range(steps):
        call(opt, model.loss(G(rank, step, scenario)))
        history.append(params(model))
        stats.append(dict(opt.last_step_stats))
    assert model.unused.grad is None
    return {"history": history, "stats": stats, "state": opt.state_dict()["strategies"], "opt": opt}


def options_world(rank, world_size):
    import troupe

    out = {}
    # 1: top-K with error feedback, one bucket per parameter.
    r = run_steps(rank, 1, 3, lambda o, l: o.backward_and_sparse_update(l, spars=0.25, topK=True), bucket_size=1)
    # a fresh DistOpt restores the residuals from a checkpoint
    _, fresh = make(bucket_size=1)
    fresh.load_state_dict(r["opt"].state_dict())
    restored = fresh.state_dict()["strategies"]["residuals"]
    out["topk"] = {k: v for k, v in r.items() if k != "opt"} | {"restored": restored}
    # 1b: the same with b (3 elements) below min_compress_size: sent dense, no residual
    r = run_steps(
        rank, 1, 2, lambda o, l: o.backward_and_sparse_update(l, spars=0.25, topK=True), bucket_size=1,
        min_compress_size=4,
    )
    out["topk_small"] = {k: v for k, v in r.items() if k != "opt"}
    # 2: threshold with error feedback, one fused bucket, one dense warm-up step; rank 2 sends nothing.
    r = run_steps(rank, 2, 3, lambda o, l: o.update(l, "sparseThreshold", spars=0.8), warmup_steps=1)
    out["threshold"] = {k: v for k, v in r.items() if k != "opt"}
    # 2b: the same without error feedback
    r = run_steps(rank, 2, 2, lambda o, l: o.backward_and_sparse_update(l, spars=0.8, corr=False))
    out["threshold_nocorr"] = {k: v for k, v in r.items() if k != "opt"}
    # 2c: a threshold no element passes on any rank; b travels dense (and the flags with it)
    r = run_steps(rank, 2, 1, lambda o, l: o.backward_and_sparse_update(l, spars=1e9), min_compress_size=4)
    out["threshold_none"] = {k: v for k, v in r.items() if k != "opt"}
    # 3: fp16 and bf16 with clipping; b (3 elements) stays fp32 below min_compress_size.
    for dtype in ("fp16", "bf16"):
        r = run_steps(
            rank, 3, 2, lambda o, l, d=dtype: o.backward_and_update_half(l, clipping=True, dtype=d), min_compress_size=4
        )
        out[dtype] = {k: v for k, v in r.items() if k != "opt"}
    # 3b: fp16 without clipping, one fused bucket: the flags ride in the fp16 payload
    r = run_steps(rank, 3, 2, lambda o, l: o.update(l, "fp16"))
    out["fp16_fused"] = {k: v for k, v in r.items() if k != "opt"}
    # 4: partial update: chunks of 16, full averaging every 3rd step, one warm-up step.
    r = run_steps(
        rank, 4, 7, lambda o, l: o.update(l, "partialUpdate"), chunk_size=16, full_sync_every=3, warmup_steps=1
    )
    out["partial"] = {k: v for k, v in r.items() if k != "opt"}
    # bad input: raised before any collective, so no rank hangs
    model, opt = make()
    errors = []
    for call in (
        lambda: opt.backward_and_sparse_update(model.loss(G(rank, 0, 1)), spars=0.0, topK=True),
        lambda: opt.backward_and_sparse_update(model.loss(G(rank, 0, 1)), spars=1.5, topK=True),
        lambda: opt.backward_and_sparse_update(model.loss(G(rank, 0, 1)), spars=-0.1, topK=False),
        lambda: opt.update(model.loss(G(rank, 0, 1)), "sparseTopk"),
        lambda: opt.backward_and_update_half(model.loss(G(rank, 0, 1)), dtype="fp8"),
    ):
        with pytest.raises(ValueError) as e:
            call()
        errors.append(str(e.value))
    double = nn.Linear(2, 2).double()
    opt64 = troupe.DistOpt(torch.optim.SGD(double.parameters(), lr=0.1))
    opt64.sync_parameters(double)
    with pytest.raises(ValueError) as e:
        opt64.backward_and_update_half(double(torch.ones(1, 2, dtype=torch.float64)).sum())
    errors.append(str(e.value))
    out["errors"] = errors
    return out


# --- references -----------------------------------------------------------------------


def topk_select(c, spars):
    k = math.ceil(round(spars * c.numel(), 9))
    keep = torch.zeros_like(c, dtype=torch.bool).view(-1)
    keep[c.reshape(-1).abs().sort(descending=True).indices[:k]] = True
    return torch.where(keep.view_as(c), c, torch.zeros_like(c))


def sparse_reference(scenario, steps, select, corr, per="param", warmup=0, dense=()):
    """Parameters after each step; per="param" compresses each parameter alone, "bucket" all together."""
    p = params(Linear())
    history, residual = [dict(p)], [None] * WORLD
    for step in range(steps):
        sent_sum = {n: torch.zeros(SHAPES[n]) for n in NAMES}
        for r in range(WORLD):
            g = G(r, step, scenario)
            if step < warmup:
                sent = g
            elif per == "param":
                res = residual[r] or {n: torch.zeros(SHAPES[n]) for n in NAMES}
                c = {n: g[n] + res[n] for n in NAMES} if corr else g
                sent = {n: c[n] if n in dense else select(c[n]) for n in NAMES}
                residual[r] = {n: c[n] - sent[n] for n in NAMES}
            else:  # one fused bucket: parameters in reverse order, back to back
                flat = torch.cat([g[n].reshape(-1) for n in reversed(NAMES)])
                c = flat + residual[r] if (corr and residual[r] is not None) else flat
                s = select(c)
                residual[r] = c - s
                sent, off = {}, 0
                for n in reversed(NAMES):
                    k = math.prod(SHAPES[n])
                    sent[n] = s[off : off + k].view(SHAPES[n])
                    off += k
            for n in NAMES:
                sent_sum[n] += sent[n]
        p = {n: p[n] - sent_sum[n] / WORLD for n in NAMES}
        history.append(dict(p))
    return history, residual


def assert_history(got, expected, atol=1e-6, rtol=1e-6):
    assert len(got) == len(expected)
    for step, (g, e) in enumerate(zip(got, expected)):
        for n in NAMES:
            torch.testing.assert_close(g[n], e[n], atol=atol, rtol=rtol, msg=f"{n} after step {step}")


@pytest.fixture(scope="module")
def results():
    return run_world(options_world, WORLD, timeout=120)


def test_topk_sum_and_residual(results):
    expected, residual = sparse_reference(1, 3, lambda c: topk_select(c, 0.25), corr=True)
    for rank, res in enumerate(results):
        out = res["topk"]
        assert_history(out["history"], expected)
        # one bucket per parameter, in reverse order: bucket0 is the last parameter
        buckets = {f"bucket{i}": n for i, n in enumerate(["unused", *reversed(NAMES)])}
        got = {buckets[k]: v for k, v in out["state"]["residuals"].items()}
        assert set(got) == {*NAMES, "unused"} and not got.pop("unused").any()
        for n in NAMES:
            torch.testing.assert_close(got[n].view(SHAPES[n]), residual[rank][n], atol=1e-6, rtol=0)
            torch.testing.assert_close(out["restored"][next(k for k, v in buckets.items() if v == n)], got[n])
        assert all(0 < s["ratio"] < 1 and s["compressed"] for s in out["stats"])
        assert out["stats"][-1]["residual_norm"] == pytest.approx(
            math.sqrt(sum(float(residual[rank][n].pow(2).sum()) for n in NAMES)), rel=1e-5
        )


def test_topk_leaves_small_tensors_dense(results):
    expected, _ = sparse_reference(1, 2, lambda c: topk_select(c, 0.25), corr=True, dense=("b",))
    for res in results:
        assert_history(res["topk_small"]["history"], expected)
        assert "bucket1" not in res["topk_small"]["state"]["residuals"]  # b's bucket: never compressed


def test_threshold_sum_residual_and_empty_rank(results):
    select = lambda c: torch.where(c.abs() >= 0.8, c, torch.zeros_like(c))  # noqa: E731
    expected, residual = sparse_reference(2, 3, select, corr=True, per="bucket", warmup=1)
    assert not select(torch.cat([G(2, s, 2)[n].reshape(-1) for n in NAMES for s in range(3)])).any()
    for rank, res in enumerate(results):
        out = res["threshold"]
        assert_history(out["history"], expected)
        # the fused bucket holds the parameters in reverse order: unused (2 elements) first
        bucket = out["state"]["residuals"]["bucket0"]
        assert not bucket[:2].any()
        torch.testing.assert_close(bucket[2:], residual[rank])
        assert [s["compressed"] for s in out["stats"]] == [False, True, True]
    expected, _ = sparse_reference(2, 2, select, corr=False, per="bucket")
    for res in results:
        assert_history(res["threshold_nocorr"]["history"], expected)
        assert res["threshold_nocorr"]["state"]["residuals"] == {}


def test_threshold_selecting_nothing_anywhere(results):
    before = params(Linear())
    mean_b = sum(G(r, 0, 2)["b"] for r in range(WORLD)) / WORLD
    for res in results:
        after = res["threshold_none"]["history"][1]
        assert torch.equal(after["w1"], before["w1"]) and torch.equal(after["w2"], before["w2"])
        torch.testing.assert_close(after["b"], before["b"] - mean_b)


@pytest.mark.parametrize("dtype,eps", [("fp16", 2**-10), ("bf16", 2**-7)])
def test_half_precision_mean_within_codec_precision(results, dtype, eps):
    p = params(Linear())
    for step in range(2):
        mean = {n: sum(G(r, step, 3)[n].clamp(-100, 100) for r in range(WORLD)) / WORLD for n in NAMES}
        before, p = p, {n: p[n] - mean[n] for n in NAMES}
        for res in results:
            got = res[dtype]["history"]
            for n in NAMES:
                delivered = got[step][n] - got[step + 1][n]
                if n == "b":  # below min_compress_size: exact fp32
                    torch.testing.assert_close(delivered, mean[n], atol=1e-6, rtol=1e-6)
                else:  # each rank's g/3 rounded once, the sum rounded at most twice more
                    tol = 4 * eps * sum(G(r, step, 3)[n].clamp(-100, 100).abs() for r in range(WORLD)) / WORLD
                    assert torch.all((delivered - mean[n]).abs() <= tol + 1e-6), (dtype, n, step)
    ratio = results[0][dtype]["stats"][-1]["ratio"]
    assert 0.4 < ratio < 0.6


def test_fp16_divides_before_the_sum(results):
    p = params(Linear())
    for step in range(2):
        mean = {n: sum(G(r, step, 3)[n] for r in range(WORLD)) / WORLD for n in NAMES}
        for res in results:
            got = res["fp16_fused"]["history"]
            for n in NAMES:
                delivered = got[step][n] - got[step + 1][n]
                assert torch.isfinite(delivered).all()
                torch.testing.assert_close(delivered, mean[n], rtol=2**-9, atol=1e-3)
    assert mean["w1"][3] == 5e4  # the sum (1.5e5) would not fit in fp16


def test_partial_update_rotates_chunks_and_keeps_the_rest_local(results):
    from troupe.strategies.partial import plan_chunks

    chunks = plan_chunks([torch.zeros(s) for s in SHAPES.values()] + [torch.zeros(2)], 16)
    assert [sum(p.stop - p.start for p in c) for c in chunks] == [16, 16, 16, 16, 11]
    start = params(Linear())
    local = [dict(start) for _ in range(WORLD)]
    counter, chunk_of_step = 0, []
    for step in range(7):
        grads = [G(r, step, 4) for r in range(WORLD)]
        if step == 0:  # warm-up: dense gradient averaging
            local = [{n: local[r][n] - sum(g[n] for g in grads) / WORLD for n in NAMES} for r in range(WORLD)]
            chunk_of_step.append(None)
        else:
            local = [{n: local[r][n] - grads[r][n] for n in NAMES} for r in range(WORLD)]
            if (step + 1) % 3 == 0:
                averaged = range(len(chunks))
                chunk_of_step.append(None)
            else:
                averaged = [counter % len(chunks)]
                chunk_of_step.append(counter % len(chunks))
                counter += 1
            flat = [torch.cat([local[r][n].reshape(-1) for n in NAMES] + [torch.zeros(2)]) for r in range(WORLD)]
            offsets = dict(zip(range(4), [0, 40, 70, 73]))  # w1, w2, b, unused in flat
            for c in averaged:
                for piece in chunks[c]:
                    sl = slice(offsets[piece.param] + piece.start, offsets[piece.param] + piece.stop)
                    mean = sum(f[sl] for f in flat) / WORLD
                    for f in flat:
                        f[sl] = mean
            local = [
                {n: flat[r][offsets[i] : offsets[i] + math.prod(SHAPES[n])].view(SHAPES[n]) for i, n in enumerate(NAMES)}
                for r in range(WORLD)
            ]
        for rank, res in enumerate(results):
            for n in NAMES:
                torch.testing.assert_close(res["partial"]["history"][step + 1][n], local[rank][n], msg=f"{n} step {step}")
    for res in results:
        stats = res["partial"]["stats"]
        assert [s.get("chunk") for s in stats] == chunk_of_step
        assert res["partial"]["state"]["partial_counter"] == counter
        # one chunk of 16 elements of about 75 + flags: a small fraction of dense
        assert 0 < stats[1]["ratio"] < 0.3
    # ranks really differ outside the averaged chunk
    assert not torch.equal(results[0]["partial"]["history"][-1]["w1"], results[1]["partial"]["history"][-1]["w1"])


def test_bad_input_names_the_value(results):
    errors = results[0]["errors"]
    assert "0.0" in errors[0] and "(0, 1]" in errors[0]
    assert "1.5" in errors[1]
    assert "-0.1" in errors[2]
    assert "'sparseTopk'" in errors[3] and "sparseTopK" in errors[3]
    assert "'fp8'" in errors[4]
    assert "float64" in errors[5] and "weight" in errors[5]
