"""Train a word-level LSTM language model with tied embeddings on a text file, with troupe.DistOpt.

    troupe run -n 2 examples/word_lm.py --text book.txt --epochs 10
    troupe run -n 2 examples/word_lm.py --epochs 3        # offline: the text that ships with troupe
    torchrun --nproc-per-node 2 examples/word_lm.py --text book.txt

Without `--text` the script trains on ``troupe/assets/troupe_docs.txt``: the prose of
troupe's own README and docs (about 90 KB, Apache-2.0 like the package), shipped for offline runs.

The text is lower-cased and split into words and punctuation marks; every rank builds the
same vocabulary from the training part (the first 90%, by count, ties by spelling), the
rest is validation. Each rank trains on its own contiguous slice of the token stream, cut
into `--batch-size` parallel streams and windows of `--bptt` tokens (truncated
backpropagation through time; the LSTM state carries over between windows). The decoder
shares its weight with the embedding (one parameter used by two modules: DistOpt reduces
it once). Each optimizer step is `--accum` windows, the first ones under `sgd.no_sync()`,
then `sgd.synchronize()` and `troupe.clip_grad_norm_`.
"""

from __future__ import annotations

import argparse
import importlib.resources
import math
import re
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import troupe
from troupe.script.metrics import progress, reduce_variable

UNK = "<unk>"
TOKEN = re.compile(r"\w+|[^\w\s]")
"""A token: a run of letters/digits/underscore, or one punctuation mark."""


def default_text() -> Path:
    """The text that ships with troupe for offline runs."""
    return Path(str(importlib.resources.files("troupe") / "assets" / "troupe_docs.txt"))


def tokenize(text: str) -> list[str]:
    """Lower-cased words and punctuation marks, with an end-of-line token per non-empty line."""
    tokens: list[str] = []
    for line in text.lower().splitlines():
        words = TOKEN.findall(line)
        if words:
            tokens += words + ["<eos>"]
    return tokens


class Vocab:
    """Word <-> id; the same on every rank (ordered by count, then spelling); rare words map to <unk>."""

    def __init__(self, tokens: list[str], max_size: int):
        counts = Counter(tokens)
        words = sorted(counts, key=lambda w: (-counts[w], w))[: max_size - 1]
        self.itos = [UNK] + words
        self.stoi = {w: i for i, w in enumerate(self.itos)}
        self.counts = torch.tensor([0] + [counts[w] for w in words], dtype=torch.float64)
        self.counts[0] = sum(counts.values()) - self.counts.sum()

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, tokens: list[str]) -> Tensor:
        return torch.tensor([self.stoi.get(t, 0) for t in tokens], dtype=torch.long)

    def unigram_perplexity(self, ids: Tensor) -> float:
        """Perplexity of `ids` under the training counts (add-one smoothed): the bar to beat."""
        p = (self.counts + 1) / (self.counts.sum() + len(self))
        return math.exp(-p.log()[ids].mean().item())


def streams(ids: Tensor, rank: int, world_size: int, batch_size: int) -> Tensor:
    """This rank's contiguous slice of `ids`, as `batch_size` parallel streams: shape (length, batch_size)."""
    per_rank = len(ids) // world_size
    part = ids[rank * per_rank : (rank + 1) * per_rank]
    length = len(part) // batch_size
    if length < 2:
        raise ValueError(f"{len(ids)} tokens are too few for {world_size} rank(s) x --batch-size {batch_size}")
    return part[: length * batch_size].view(batch_size, length).t().contiguous()


def windows(data: Tensor, bptt: int) -> list[tuple[Tensor, Tensor]]:
    """(input, target) windows of up to `bptt` time steps; the target is the input shifted by one."""
    return [(data[i : i + bptt], data[i + 1 : i + 1 + bptt]) for i in range(0, len(data) - 1, bptt)
            if len(data[i + 1 : i + 1 + bptt]) == len(data[i : i + bptt])]


class WordLM(nn.Module):
    """Embedding -> LSTM -> linear decoder whose weight *is* the embedding's (Press & Wolf, Inan et al.)."""

    def __init__(self, vocab_size: int, dim: int, layers: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.lstm = nn.LSTM(dim, dim, layers, dropout=dropout if layers > 1 else 0.0)
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(dim, vocab_size)
        self.decoder.weight = self.embed.weight  # tied: one parameter, two modules
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, x: Tensor, state=None):
        y, state = self.lstm(self.drop(self.embed(x)), state)
        return self.decoder(self.drop(y)), state


def detach(state):
    return tuple(s.detach() for s in state)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default=None, help="a UTF-8 text file (default: the text shipped with troupe)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="parallel streams per rank")
    p.add_argument("--bptt", type=int, default=35, help="time steps per window (truncated BPTT)")
    p.add_argument("--dim", type=int, default=256, help="embedding and LSTM width (equal: the weights are tied)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate (cosine decay to 0)")
    p.add_argument("--clip", type=float, default=0.5, help="clip_grad_norm_ to this (0: no clipping)")
    p.add_argument("--accum", type=int, default=1, help="windows per optimizer step (the first K-1 under no_sync)")
    p.add_argument("--vocab-size", type=int, default=10_000, help="most frequent words kept; the rest are <unk>")
    p.add_argument("--valid-fraction", type=float, default=0.1, help="the end of the text held out")
    p.add_argument("--dist-option", default="plain", help=f"one of {sorted(troupe.DIST_OPTIONS)}")
    p.add_argument("--max-steps", type=int, default=None, help="stop each epoch after this many steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads per process")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "bptt", "dim", "layers", "accum", "vocab_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.valid_fraction < 1:
        p.error(f"--valid-fraction must be in (0, 1), got {args.valid_fraction}")
    if args.text is not None and not Path(args.text).expanduser().is_file():
        p.error(f"--text {args.text}: no such file")
    return args


def load(args) -> tuple[Vocab, Tensor, Tensor]:
    """(vocabulary, training ids, validation ids); deterministic, so every rank computes the same."""
    path = Path(args.text).expanduser() if args.text else default_text()
    tokens = tokenize(path.read_text(encoding="utf-8", errors="replace"))
    cut = int(len(tokens) * (1 - args.valid_fraction))
    vocab = Vocab(tokens[:cut], args.vocab_size)
    return vocab, vocab.encode(tokens[:cut]), vocab.encode(tokens[cut:])


def evaluate(model, data: Tensor, bptt: int) -> tuple[float, int]:
    """(summed loss, tokens) over this rank's validation streams."""
    model.eval()
    total, count, state = 0.0, 0, None
    with torch.no_grad():
        for x, y in windows(data, bptt):
            out, state = model(x, state)
            total += F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum").item()
            count += y.numel()
    return total, count


def train_step(model, sgd, group, state, args) -> tuple[float, tuple]:
    """One optimizer step over the windows in `group`; returns (mean loss, LSTM state)."""
    loss_sum = 0.0
    for i, (x, y) in enumerate(group):
        with nullcontext() if i == len(group) - 1 else sgd.no_sync():  # only the last backward communicates
            out, state = model(x, state)
            loss = F.cross_entropy(out.flatten(0, 1), y.flatten()) / len(group)
            loss.backward()
        state = detach(state)  # truncated BPTT: no gradient into the previous window
        loss_sum += loss.item()
    sgd.synchronize()  # p.grad: the mean over ranks
    if args.clip:
        troupe.clip_grad_norm_(model.parameters(), args.clip)
    sgd.step()
    sgd.zero_grad()
    return loss_sum, state


def train(args):
    """Train; returns the per-epoch history (rank 0 prints)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    vocab, train_ids, valid_ids = load(args)
    model = WordLM(len(vocab), args.dim, args.layers, args.dropout)
    sgd = troupe.DistOpt(torch.optim.Adam(model.parameters(), lr=args.lr), dist_option=args.dist_option)
    rank, world_size, main = sgd.global_rank, sgd.world_size, sgd.global_rank == 0
    train_data = streams(train_ids, rank, world_size, args.batch_size)
    valid_data = streams(valid_ids, rank, world_size, min(args.batch_size, 10))
    wins = windows(train_data, args.bptt)
    steps = len(wins) // args.accum
    if args.max_steps:
        steps = min(steps, args.max_steps)
    if steps == 0:
        raise ValueError(f"--accum {args.accum} is more than this rank's {len(wins)} windows")
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(sgd, args.epochs * steps)
    if main:
        source = args.text or f"{default_text()} (no --text: the text shipped with troupe, offline run)"
        n = sum(p.numel() for p in model.parameters())
        print(f"Text: {source}", flush=True)
        print(f"{sgd}: {len(train_ids)} training tokens ({train_data.numel()} per rank), {len(valid_ids)} validation, "
              f"vocabulary {len(vocab)}, {n / 1e6:.2f}M parameters", flush=True)
        print(f"Unigram perplexity = {vocab.unigram_perplexity(valid_ids):.2f} (validation, the bar to beat)",
              flush=True)

    history, step = [], 0
    for epoch in range(args.epochs):
        if main:
            print(f"Starting Epoch {epoch}:", flush=True)
        model.train()
        state, loss_sum, start = None, 0.0, time.perf_counter()
        for s in progress(range(steps), desc=f"epoch {epoch}", enabled=main and not args.quiet):
            loss, state = train_step(model, sgd, wins[s * args.accum : (s + 1) * args.accum], state, args)
            loss_sum += loss
            sched.step()
            step += 1
        # every rank's tokens over this rank's time (what metrics.Throughput reports for samples)
        rate = steps * args.accum * args.bptt * args.batch_size * world_size / (time.perf_counter() - start)
        train_ppl = math.exp(reduce_variable(loss_sum) / (steps * world_size))
        total, count = evaluate(model, valid_data, args.bptt)
        valid_ppl = math.exp(reduce_variable(total) / reduce_variable(count))
        if main:
            print(f"Training perplexity = {train_ppl:.2f}, {rate:.0f} tokens/s (all ranks)", flush=True)
            print(f"Validation perplexity = {valid_ppl:.2f}", flush=True)
        troupe.log({"epoch/train_perplexity": train_ppl, "epoch/valid_perplexity": valid_ppl,
                    "epoch/lr": sgd.param_groups[0]["lr"]}, step)
        history.append({"epoch": epoch, "train_ppl": train_ppl, "valid_ppl": valid_ppl, "tokens_per_s": rate})
    return history


def main(argv=None):
    history = train(parse_args(argv))
    return history


if __name__ == "__main__":
    main()
