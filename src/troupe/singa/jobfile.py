"""SINGA's job files: the protocol-buffer text of a JobProto, read for its one ``cluster { }`` block.

A job.conf holds the whole job (``name``, ``neuralnet { layer { ... } }``, ``updater``,
``cluster { ... }``); troupe needs only the cluster block. `cluster_fields` finds it wherever
it is, returns its ``key: value`` pairs as Python values, and warns naming what it skipped:
the other top-level fields, and SINGA's cluster fields troupe has no use for. Pure text in,
a dict out (nothing of troupe's imported): `troupe.cluster.configuration.sources` turns the dict into a
`ClusterConfig`.
"""

from __future__ import annotations

import re
import warnings

_TOKEN = re.compile(r"""(?P<space>\s+)|(?P<comment>\#[^\n]*)|(?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')"""
                    r"""|(?P<punct>[{}<>:;,\[\]])|(?P<word>[^\s{}<>:;,\[\]"'\#]+)""")
"""Protocol-buffer text format, the language of SINGA's job.conf: words, quoted strings, punctuation."""

SINGA_ONLY_FIELDS = ("workspace", "hostfile", "start_port", "poll_time", "log_dir", "zookeeper_host", "bandwidth",
                     "nprocs", "server_update", "msg_timeout")
"""ClusterProto fields of SINGA 0.x that troupe has no use for (paths, ports, ZooKeeper): ignored with a warning."""


def _tokens(text: str) -> list[tuple[str, str, int]]:
    """(kind, text, line) of every token but spaces and comments."""
    out, pos, line = [], 0, 1
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"line {line}: cannot read {text[pos:pos + 20]!r}")
        if m.lastgroup not in ("space", "comment"):
            out.append((m.lastgroup, m.group(), line))
        line += m.group().count("\n")
        pos = m.end()
    return out


def _cluster_tokens(tokens: list[tuple[str, str, int]]) -> tuple[list[tuple[str, str, int]] | None, list[str]]:
    """The tokens inside the job's one ``cluster { ... }`` block (wherever it is), and the
    names of the top-level fields around it."""
    def at(k: int) -> str:
        return tokens[k][1] if 0 <= k < len(tokens) and tokens[k][0] == "punct" else ""

    depth, blocks, others, k = 0, [], [], 0
    while k < len(tokens):
        kind, text, line = tokens[k]
        if at(k) in ("{", "<"):
            depth += 1
        elif at(k) in ("}", ">"):
            depth -= 1
            if depth < 0:
                raise ValueError(f"line {line}: '{text}' without an opening brace")
        elif kind == "word" and at(k - 1) != ":":  # a field's name, not a value
            opening = k + 1 if at(k + 1) in ("{", "<") else k + 2 if at(k + 1) == ":" and at(k + 2) in ("{", "<") \
                else None
            if text == "cluster" and opening is not None:
                end = _closing(tokens, opening)
                blocks.append(tokens[opening + 1:end])
                k = end + 1
                continue
            if depth == 0 and at(k + 1) in (":", "{", "<") and text not in others:
                others.append(text)
        k += 1
    if depth:
        raise ValueError(f"{depth} brace(s) left open at the end of the job file")
    if len(blocks) > 1:
        raise ValueError(f"the job file has {len(blocks)} cluster blocks; give one")
    return (blocks[0] if blocks else None), others


def _closing(tokens: list[tuple[str, str, int]], start: int) -> int:
    """The index of the brace closing the one at `start`."""
    depth = 0
    for k in range(start, len(tokens)):
        if tokens[k][0] == "punct" and tokens[k][1] in "{<":
            depth += 1
        elif tokens[k][0] == "punct" and tokens[k][1] in "}>":
            depth -= 1
            if depth == 0:
                return k
    raise ValueError(f"line {tokens[start][2]}: the cluster block is never closed")


def _value(key: str, raw: str) -> int | float | bool | str:
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    if key in ("group_merge", "send_updates", "wire_dtype", "fetch", "staleness_lr", "framework", "outer_optimizer",
               "pseudo_grad_dtype", "shard"):
        return raw.strip("\"'")
    if key in ("wire_topk", "outer_lr", "outer_momentum", "merge_alpha"):  # a fraction or a rate
        try:
            return float(raw)
        except ValueError:
            what = "a fraction in (0, 1)" if key == "wire_topk" else "a number"
            raise ValueError(f"cluster field {key}: expected {what}, got {raw!r}") from None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"cluster field {key}: expected an integer or true/false, got {raw!r}") from None


def _block_fields(tokens: list[tuple[str, str, int]]) -> dict[str, int | float | bool | str]:
    """``key: value`` pairs of a cluster block (any layout: one per line, several per line, ; or ,)."""
    fields: dict[str, int | float | bool | str] = {}
    ignored: list[str] = []
    k = 0
    while k < len(tokens):
        kind, key, line = tokens[k]
        if kind == "punct" and key in (";", ","):
            k += 1
            continue
        sep, value = tokens[k + 1:k + 2], tokens[k + 2:k + 3]
        if kind != "word" or not sep or sep[0][1] not in (":", "=") or not value or value[0][0] == "punct":
            got = " ".join(t[1] for t in tokens[k:k + 3])
            raise ValueError(f"cluster block, line {line}: expected `key: value`, got {got!r}")
        if key in SINGA_ONLY_FIELDS:
            ignored.append(key)
        elif key in fields:
            raise ValueError(f"cluster block, line {line}: field {key} given twice")
        else:
            vkind, raw, _ = value[0]
            try:
                fields[key] = _value(key, raw[1:-1] if vkind == "string" else raw)
            except ValueError as e:
                raise ValueError(f"cluster block, line {line}: {e}") from None
        k += 3
    if ignored:
        warnings.warn(f"cluster block: ignored SINGA field(s) troupe has no use for: {', '.join(ignored)}",
                      stacklevel=3)
    return fields


def has_cluster_block(text: str) -> bool:
    """Does `text` hold a ``cluster { ... }`` block (protocol-buffer text rather than TOML)?"""
    return re.search(r"\bcluster\s*:?\s*[{<]", text) is not None


def cluster_fields(text: str) -> dict[str, int | float | bool | str]:
    """The fields of the one cluster block in the job file `text` (ValueError, with the line, when
    it is malformed); warns naming the JobProto fields around it, which troupe skips."""
    block, others = _cluster_tokens(_tokens(text))
    if block is None:
        raise ValueError("no top-level `cluster { ... }` block in the job file")
    if others:
        warnings.warn(f"job file: ignored the JobProto fields outside the cluster block: {', '.join(others)}",
                      stacklevel=3)
    return _block_fields(block)
