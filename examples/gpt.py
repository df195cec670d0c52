"""Train a GPT-2-shaped transformer (tied embeddings, AdamW, warm-up + cosine) on a text, with troupe.DistOpt.

    troupe run -n 2 examples/gpt.py                              # data parallel, the shipped text
    troupe run -n 4 --shard optimizer examples/gpt.py            # optimizer state cut over 4 ranks (ZeRO-1)
    troupe run -n 4 --shard gradients examples/gpt.py --accum 4  # and the reduced gradients (ZeRO-2)
    troupe run -n 4 examples/gpt.py --shard parameters           # and the parameters: troupe.shard (FSDP2)
    troupe run -n 4 examples/gpt.py --layers 12 --dim 768 --heads 12   # GPT-2 small's body (85M parameters)

The model is nanoGPT's: token and position embeddings, pre-norm blocks of causal self-attention
and a 4x GELU MLP, a final LayerNorm, and an output layer that shares the token embedding's
weight. AdamW decays the matrices and not the biases, norms or position table (two parameter
groups); the learning rate warms up linearly, then follows a cosine to a tenth. Each optimizer
step accumulates `--accum` micro-batches (all but the last under ``sgd.no_sync()``) and clips
the whole model's gradient norm with `troupe.clip_grad_norm_` (which also sums a sharded
model's parts). Tokens are the text's bytes (a vocabulary of 256), so nothing is downloaded;
without `--text` the script trains on the prose that ships with troupe (about 90 KB).
"""

from __future__ import annotations

import argparse
import importlib.resources
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import troupe
from troupe.script.metrics import reduce_variable

VOCAB = 256


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embeddings, `layers` blocks, final norm, output tied to the token embedding."""

    def __init__(self, dim: int = 128, layers: int = 4, heads: int = 4, block_size: int = 128):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(block_size, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's two groups: matrices decay; biases, norms and the position table do not."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("pos.")]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and not n.startswith("pos."))]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def schedule(warmup: int, total: int):
    """Linear warm-up, then a cosine from 1 to 0.1 (a multiplier of the base learning rate)."""
    def at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
    return at


def load(path: str | None) -> tuple[Tensor, Tensor]:
    """The text's bytes: the first 90% to train on, the rest to validate."""
    text = Path(path) if path else Path(str(importlib.resources.files("troupe") / "assets" / "troupe_docs.txt"))
    data = torch.frombuffer(bytearray(text.read_bytes()), dtype=torch.uint8).long()
    cut = int(0.9 * len(data))
    return data[:cut], data[cut:]


def batch(data: Tensor, size: int, block: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    start = torch.randint(0, len(data) - block - 1, (size,), generator=g)
    x = torch.stack([data[s : s + block] for s in start.tolist()])
    y = torch.stack([data[s + 1 : s + block + 1] for s in start.tolist()])
    return x, y


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default=None, help="a text file (default: the text shipped with troupe)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch and rank")
    p.add_argument("--block-size", type=int, default=128, help="tokens per sequence")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per step (the first K-1 under no_sync)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=20, help="steps of linear warm-up")
    p.add_argument("--clip", type=float, default=1.0, help="clip the whole model's gradient norm (0: no clipping)")
    p.add_argument("--shard", choices=["none", "optimizer", "gradients", "parameters"], default=None,
                   help="what to cut over the ranks (default: troupe run --shard, else none); parameters: "
                        "troupe.shard(model), which cuts the gradients and optimizer state too")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


@torch.no_grad()
def evaluate(model: nn.Module, data: Tensor, args, rank: int) -> float:
    model.eval()
    g = torch.Generator().manual_seed(1000 + rank)
    losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()) for x, y in
              (batch(data, args.batch_size, args.block_size, g) for _ in range(4))]
    model.train()
    return float(torch.stack(losses).mean())


def main(argv=None) -> float:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    train, valid = load(args.text)
    model = GPT(args.dim, args.layers, args.heads, args.block_size)
    if args.shard == "parameters":
        model = troupe.shard(model)  # each block gathered for its forward and backward, then freed
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    shard = args.shard if args.shard in ("optimizer", "gradients") else None
    sgd = troupe.DistOpt(opt, shard=shard)
    rank, world_size = sgd.global_rank, sgd.world_size
    sched = torch.optim.lr_scheduler.LambdaLR(sgd, schedule(args.warmup, args.steps))
    g = torch.Generator().manual_seed(args.seed * 1000 + rank)  # every rank its own batches
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"{sgd}: {n / 1e6:.2f}M parameters, {world_size} x {args.accum} x {args.batch_size} sequences "
              f"of {args.block_size} tokens per step")
    start, val = time.perf_counter(), float("nan")
    for step in range(args.steps):
        for micro in range(args.accum):
            x, y = batch(train, args.batch_size, args.block_size, g)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / args.accum
            if micro < args.accum - 1:
                with sgd.no_sync():
                    loss.backward()
            else:
                loss.backward()
        if args.clip > 0:
            troupe.clip_grad_norm_(model.parameters(), args.clip)
        sgd.step()
        sched.step()
        sgd.zero_grad()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val = reduce_variable(evaluate(model, valid, args, rank), "mean")
            if rank == 0:
                print(f"step {step + 1}: validation loss {val:.4f} ({val / math.log(2):.3f} bits per byte), "
                      f"{time.perf_counter() - start:.1f} s", flush=True)
    return val


if __name__ == "__main__":
    main()
