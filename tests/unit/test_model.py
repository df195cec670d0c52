"""troupe.Model: SINGA's compile (graph mode via torch.compile, with a fallback), set_optimizer checks."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import troupe


class Net(troupe.Model):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.fc(x))


def test_compile_runs_a_forward_and_sets_mode():
    m, x = Net(), torch.randn(2, 4)
    m.compile([x], is_train=False)
    assert not m.training and "forward" not in m.__dict__
    m.compile([x], is_train=True)
    assert m.training


def test_graph_mode_uses_torch_compile(monkeypatch):
    # dynamo's "eager" backend traces the graph without inductor's minutes of C++ compilation
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    m, x = Net(), torch.randn(2, 4)
    m.compile([x], use_graph=True)
    assert "forward" in m.__dict__  # the compiled forward shadows the method
    torch.testing.assert_close(m(x), torch.relu(m.fc(x)))
    torch.testing.assert_close(m.forward(x), torch.relu(m.fc(x)))
    m.compile([x], use_graph=False)  # back to eager
    assert "forward" not in m.__dict__


def test_graph_mode_falls_back_with_a_warning(monkeypatch):
    def broken(fn, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", broken)
    m, x = Net(), torch.randn(2, 4)
    with pytest.warns(UserWarning, match="torch.compile failed .*no compiler here.*running eagerly"):
        m.compile([x], use_graph=True)
    assert "forward" not in m.__dict__
    torch.testing.assert_close(m(x), torch.relu(m.fc(x)))


def test_set_optimizer_and_train_one_batch_errors():
    m = Net()
    with pytest.raises(TypeError, match="set_optimizer takes a DistOpt or torch optimizer"):
        m.set_optimizer("sgd")
    m.set_optimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    with pytest.raises(NotImplementedError, match="Net must define train_one_batch"):
        m.train_one_batch(torch.randn(1, 4), torch.tensor([0]))


class Trainable(Net):
    def train_one_batch(self, x, y, dist_option="plain", spars=None):
        out = self.forward(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return out, loss


def test_after_compile_for_training_model_x_y_runs_train_one_batch():
    torch.manual_seed(0)
    m, x, y = Trainable(), torch.randn(5, 4), torch.randint(0, 3, (5,))
    m.set_optimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    before = m.fc.weight.detach().clone()
    assert torch.equal(m(x), m.forward(x))  # not compiled: model(x) is forward
    m.compile([x], is_train=True)
    out, loss = m(x, y, "plain", None)  # SINGA's Model: more inputs than compile's -> train_one_batch
    assert out.shape == (5, 3) and loss.ndim == 0
    assert not torch.equal(m.fc.weight, before)
    assert torch.equal(m(x), m.forward(x))  # one input: still forward
    m.compile([x], is_train=False)
    with pytest.raises(TypeError):
        m(x, y)  # evaluation mode: forward, which takes one input
