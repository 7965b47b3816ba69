"""Packing and batching: how sequences of any length become rows of one shape.

`pack_spans` is the one packing rule of SFT, distillation, the offline drafter and the
online drafter's buffer: spans are packed greedily, in order, into rows of seq_len
tokens, each a segment of its own (attention never crosses two). `pack_examples` packs a
task's examples for supervised training; `batch_indices` and `padded_batches` draw
training and evaluation batches from the rows.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
from absl import logging

from tlt_jax.data import tasks
from tlt_jax.data.prompts import PromptFormat

_DEFAULT_FORMAT = PromptFormat()


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where greedy packing put each span: span i fills columns offset_N[i] ..
    offset_N[i] + lengths_N[i] of row row_N[i] (-1: dropped, longer than seq_len) as
    segment segment_N[i] (1, 2, ... within its row)."""

    seq_len: int
    lengths_N: np.ndarray
    row_N: np.ndarray
    offset_N: np.ndarray
    segment_N: np.ndarray
    num_rows: int

    @property
    def dropped(self) -> int:
        return int(np.sum(self.row_N < 0))

    def scatter(self, values: Sequence, dtype, fill=0) -> np.ndarray:
        """[num_rows, seq_len, ...] of `dtype`: values[i] (lengths_N[i] entries along its
        first axis) at span i's place, `fill` elsewhere. Dropped spans' values are ignored."""
        trailing = np.shape(values[0])[1:] if len(values) else ()
        out = np.full((self.num_rows, self.seq_len, *trailing), fill, dtype)
        for i in np.flatnonzero(self.row_N >= 0):
            out[self.row_N[i], self.offset_N[i]:self.offset_N[i] + self.lengths_N[i]] = values[i]
        return out

    def rows(self, tokens: Sequence, targets: Sequence, positions: Sequence | None = None, pad_id: int = 0) -> dict:
        """The row fields of the spans (the drafter trainer's `ROW_FIELDS`): int32 tokens (pad_id on
        padding), positions (default 0 .. length-1 per span) and segment_ids [num_rows,
        seq_len], and mask [num_rows, seq_len-1], True at t where token t+1 is a target
        (targets[i]: per token of span i) of its own segment."""
        if positions is None:
            positions = [np.arange(n) for n in self.lengths_N]
        out = {"tokens": self.scatter(tokens, np.int32, fill=pad_id), "positions": self.scatter(positions, np.int32),
               "segment_ids": self.scatter([np.full(n, s) for n, s in zip(self.lengths_N, self.segment_N)], np.int32)}
        target = self.scatter(targets, bool)  # target[i, t]: token t is to be predicted
        kept = self.row_N >= 0
        # A segment's first token is never a target: the previous sample's last position
        # must not learn to predict it.
        target[self.row_N[kept], self.offset_N[kept]] = False
        out["mask"] = target[:, 1:]
        return out


def pack_spans(lengths: Sequence[int], seq_len: int) -> Packing:
    """Packs spans of `lengths` (>= 1) greedily, in order, into rows of seq_len: a span
    joins the current row while it fits, else starts a new one. Spans longer than seq_len
    are dropped (`Packing.dropped`)."""
    lengths_N = np.asarray(lengths, np.int64).reshape(-1)
    if np.any(lengths_N < 1):
        raise ValueError(f"Spans are at least one token long, got lengths {lengths_N[lengths_N < 1].tolist()}.")
    row_N = np.full(len(lengths_N), -1, np.int64)
    offset_N, segment_N = np.zeros_like(row_N), np.zeros_like(row_N)
    row, at, segment = -1, 0, 0
    for i, length in enumerate(lengths_N.tolist()):
        if length > seq_len:
            continue
        if row < 0 or at + length > seq_len:
            row, at, segment = row + 1, 0, 0
        segment += 1
        row_N[i], offset_N[i], segment_N[i] = row, at, segment
        at += length
    return Packing(seq_len, lengths_N, row_N, offset_N, segment_N, row + 1)


def encode_for_sft(tokenizer, example: tasks.Example, prompt_format: PromptFormat = _DEFAULT_FORMAT,
                   end_token_id: int | None = None) -> tuple[list[int], list[int]]:
    """Token ids of the prompt (as `prompt_format` makes it: with the synthetic tasks'
    default, <bos> then the prompt), the solution and the end token (default the
    tokenizer's eos), and a mask that is 1 on the positions the model must predict (the
    solution and the end token) and 0 on the prompt."""
    prompt_ids = prompt_format.example_ids(tokenizer, example)
    solution_ids = tokenizer(example.solution, add_special_tokens=False)["input_ids"]
    end = tokenizer.eos_token_id if end_token_id is None else end_token_id
    ids = prompt_ids + solution_ids + [end]
    return ids, [0] * len(prompt_ids) + [1] * (len(solution_ids) + 1)


def pack_examples(tokenizer, examples: Sequence[tasks.Example], seq_len: int,
                  prompt_format: PromptFormat = _DEFAULT_FORMAT, end_token_id: int | None = None) -> dict:
    """Packs examples (`encode_for_sft`) greedily into rows of seq_len tokens (no padding
    wasted on short traces; `pack_spans`, which packs the drafter's data too). Returns
    int32 tokens / positions / segment_ids [n, seq_len] (segment 0 is padding) and the
    target mask [n, seq_len-1], True where position t predicts a solution token or the end
    token of its own example. Examples longer than seq_len are dropped, counted."""
    encoded = [encode_for_sft(tokenizer, example, prompt_format, end_token_id) for example in examples]
    packing = pack_spans([len(ids) for ids, _ in encoded], seq_len)
    if packing.dropped:
        logging.warning("%d of %d examples are longer than seq_len=%d and were dropped.", packing.dropped,
                        len(examples), seq_len)
    if not packing.num_rows:
        raise ValueError(f"Every example is longer than seq_len={seq_len}; raise seq_len.")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return packing.rows([ids for ids, _ in encoded], [mask for _, mask in encoded], pad_id=pad)


def batch_indices(step: int, batch_size: int, num_rows: int, seed: int) -> np.ndarray:
    """Rows of training step `step`: one shuffle per epoch, a function of the step alone
    (a resumed run draws the batches it would have drawn)."""
    order = np.random.default_rng([seed, step * batch_size // num_rows]).permutation(num_rows)
    return order[np.arange(step * batch_size, (step + 1) * batch_size) % num_rows]


def padded_batches(rows: dict, batch_size: int):
    """Yields (indices, batch) over all `pack_examples` rows in order, in batches of one
    shape: the last is filled with copies of the last row, their mask cleared."""
    n = len(rows["tokens"])
    for begin in range(0, n, batch_size):
        idx = np.arange(begin, begin + batch_size)
        real = idx < n
        idx = np.where(real, idx, n - 1)
        batch = {k: v[idx] for k, v in rows.items()}
        batch["mask"] = batch["mask"] & real[:, None]
        yield idx, batch
