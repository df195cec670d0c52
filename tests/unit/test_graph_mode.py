"""Graph mode's pieces that need no process group: argument checks, the update stand-in, the graph split."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import troupe
from troupe.graphstep import UpdateCall, check_backend
from troupe.sync.compiled import SplitCompiledGraphs, unsplit
from troupe.sync.ingraph import Codec


def test_codec_and_backend_checks():
    assert Codec("fp16", 10.0).clip_value == 10.0
    with pytest.raises(ValueError, match="graph mode reduces with one of .*'topk'"):
        Codec("topk")
    with pytest.raises(ValueError, match="clip_value must be a positive number or None, got -1"):
        Codec("fp16", -1)
    check_backend("aot_eager")
    check_backend(lambda gm, inputs: gm)
    with pytest.raises(ValueError, match="backend must be one of .* got 'tvm'"):
        check_backend("tvm")


@pytest.mark.parametrize("trial", [-1, 2.5, True])
def test_a_bad_trial_is_one_line(trial):
    from troupe.graphstep import GraphStep

    with pytest.raises(ValueError, match=f"trial must be an integer >= 0 \\(steps of each kind\\), got {trial!r}"):
        GraphStep(None, nn.Linear(2, 2), lambda x: x, lambda x: x, returns_loss=True, trial=trial)


def test_update_call_notes_the_loss_and_the_codec():
    call, loss = UpdateCall(), torch.tensor(1.0)
    call.update(loss, "fp16")
    assert call.loss is loss and call.codec == Codec("fp16")
    call.backward_and_update_half(loss, clipping=True, clip_value=5, dtype="bf16")
    assert call.codec == Codec("bf16", 5)
    call(loss)
    assert call.codec == Codec("plain")
    with pytest.raises(ValueError, match="not dist_option 'sparseTopK'; compile with use_graph=False"):
        call.update(loss, "sparseTopK")
    with pytest.raises(ValueError, match="does not run backward_and_partial_update"):
        call.backward_and_partial_update(loss)


def test_model_compile_rejects_an_unknown_backend():
    class Net(troupe.Model):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            return self.fc(x)

    with pytest.raises(ValueError, match="backend must be one of"):
        Net().compile([torch.zeros(1, 2)], use_graph=True, backend="nope")


def test_split_compiled_graphs_installs_once_and_steps_aside():
    from torch.nn.parallel import DistributedDataParallel as DDP

    assert DDP._active_ddp_module is None
    first, second = SplitCompiledGraphs(4 << 20), SplitCompiledGraphs(16)
    assert second.bucket_bytes_cap == torch.distributed._DEFAULT_FIRST_BUCKET_BYTES  # DDPOptimizer's minimum
    try:
        assert first.install() and not second.install()
        assert DDP._active_ddp_module is first
        with unsplit():
            assert DDP._active_ddp_module is None
        assert DDP._active_ddp_module is first
        second.remove()  # not the one in place: nothing changes
        assert DDP._active_ddp_module is first
    finally:
        first.remove()
    assert DDP._active_ddp_module is None
    with pytest.raises(ValueError, match="bucket_bytes_cap must be >= 1 byte, got 0"):
        SplitCompiledGraphs(0)
