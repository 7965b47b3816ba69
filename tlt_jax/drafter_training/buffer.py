"""The drafter's online data: the target's by-products of each RL step, packed into rows.

During RL the learner runs the target over every sampled sequence anyway (prompt then
response, right-padded to T). Its outputs at token t are what drafter training reads
(`trainer.target_outputs`): the final hidden state h_t, the top-K ids and log-probs of the
distribution of token t+1, and, for a fused (EAGLE-3) drafter, its feature layers' outputs
at t. `DrafterBuffer` keeps them in host memory, as numpy, for the spot trainer.

Span rule. Of a sample with prompt length p and response length r the buffer keeps tokens
[max(p - 1 - prompt_tail, 0), p + r): the response, the last prompt token and up to
`prompt_tail` prompt tokens before it. The last prompt token is always kept because
drafting starts from it: after the prompt, the drafter's first entry reads (x_p, f_{p-1}),
the target's feature at the last prompt position. Only response tokens are targets (mask);
prompt tokens are context; padding never enters a row. In a multi-turn transcript the
environment's observations (`observed_nT`) are context too: the drafter reads them, as
it does when drafting the turn after, but never learns to predict them. A span longer than seq_len first
loses prompt context (down to the last prompt token), then the end of its response
(counted as truncated): the kept tokens keep their true prefix, as at drafting time,
whereas a later chunk of the response without its prefix would teach attention over a
context that never occurs. Samples without a response token are skipped.

Rows. The samples of one `add` are packed greedily (`pack_spans`, the one packing rule of
SFT, the offline drafter and this buffer) into rows of seq_len tokens with exactly the
fields of the offline trainer's batches, so `DrafterTrainer.step` trains on them as they
are; R rows, S = seq_len:
    tokens       int32 [R, S]      pad 0
    positions    int32 [R, S]      the token's position in its original sequence (RoPE sees
                                   the positions of the target's forward)
    segment_ids  int32 [R, S]      1, 2, ... per sample within a row; 0 is padding
    mask         bool  [R, S-1]    entry t: token t+1 is a target (a response token the model
                                   sampled, not an observation) of its own segment
    hidden       [R, S, D]         h_t, in the dtype given (bf16 stays bf16)
    ids, logp    int32 / f32 [R, S, K]   top-K of the distribution of token t+1
    layers       [R, S, n, D]      fused drafters only: the feature layers' outputs at t
Every other entry of a row is zero. Segment ids keep the samples of a row apart: attention
never crosses two samples (the reference instead packs samples into one causal sequence
whose attention crosses them, so a sample's features are learned against context that the
drafter never sees when drafting).

Memory. A row takes S * (12 + D*b + 8K + n*D*b) + S - 1 bytes, b the bytes per feature
(hidden size 3584, bf16, K = 8, S = 4096: 28 MiB, nearly all hidden states).
`max_bytes` (config `tlt.drafter.buffer_max_bytes`) bounds the rows held; the oldest go first.
Greedy packing wastes only the tail of each row; `add` briefly holds the batch's outputs on
host beside the rows it builds.

Replay. With `replay_share` > 0 the rows that leave the window of `keep_steps` RL steps are
not all dropped: a uniform reservoir sample of every row evicted so far (up to half the
rows `max_bytes` holds; the window keeps the other half) stays, and each batch draws that
share of its rows from it, the rest from the window. A drafter that follows a moving
target on a few rows a step then also keeps seeing what drafted well before.
"""
from __future__ import annotations

import dataclasses

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np

from tlt_jax.data.packing import pack_spans

# ----------------------------------------------------------------------------- buffer


@dataclasses.dataclass
class _Chunk:
    """The rows of one `add`, all of RL step `step`."""
    step: int
    rows: dict

    def __len__(self) -> int:
        return len(self.rows["tokens"])


class DrafterBuffer:
    """FIFO of packed rows over the last `keep_steps` RL steps, at most `max_bytes` of them.

    Args:
      seq_len: tokens per row (S).
      hidden_size, top_k: D and K of the target outputs `add` receives.
      max_bytes: bound on the bytes of the rows held (config `tlt.drafter.buffer_max_bytes`).
        Checked here against one row's size, so a bound too small fails before any RL step.
      num_feature_layers: n, the fused drafter's feature layers (0: unfused, no "layers").
      feature_dtype: dtype of hidden (and layers) as the learner hands them; stored as is.
      keep_steps: RL steps whose rows are kept (2: this step and the previous).
      prompt_tail: prompt tokens kept before the last one (see the module docstring).
      seed: of `sample`'s draws.
      replay_share: the share of each batch drawn from the replay reservoir of rows older
        than the window (0: none kept; see the module docstring), in [0, 1].
    """

    def __init__(self, seq_len: int, hidden_size: int, top_k: int, *, max_bytes: int, num_feature_layers: int = 0,
                 feature_dtype="float32", keep_steps: int = 2, prompt_tail: int = 0, seed: int = 0,
                 replay_share: float = 0.0):
        if seq_len < 2 or keep_steps < 1 or prompt_tail < 0 or seed < 0:
            raise ValueError(f"DrafterBuffer needs seq_len >= 2, keep_steps >= 1, prompt_tail >= 0 and seed >= 0; "
                             f"got {seq_len}, {keep_steps}, {prompt_tail}, {seed}.")
        if not 0 <= replay_share <= 1:
            raise ValueError(f"tlt.drafter.replay_share={replay_share} must be in [0, 1] (the share of each drafter "
                             "batch drawn from rows older than the buffer's window; 0: none).")
        self.replay_share = replay_share
        self.seq_len, self.hidden_size, self.top_k = seq_len, hidden_size, top_k
        self.num_feature_layers, self.feature_dtype = num_feature_layers, np.dtype(feature_dtype)
        self.max_bytes, self.keep_steps, self.prompt_tail, self.seed = max_bytes, keep_steps, prompt_tail, seed
        s, d, k, f = seq_len, hidden_size, top_k, self.feature_dtype
        self._fields = {"tokens": ((s,), np.dtype(np.int32)), "positions": ((s,), np.dtype(np.int32)),
                        "segment_ids": ((s,), np.dtype(np.int32)), "mask": ((s - 1,), np.dtype(bool)),
                        "hidden": ((s, d), f), "ids": ((s, k), np.dtype(np.int32)),
                        "logp": ((s, k), np.dtype(np.float32))}
        if num_feature_layers:
            self._fields["layers"] = ((s, num_feature_layers, d), f)
        self.row_bytes = sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in self._fields.values())
        if max_bytes < self.row_bytes:
            raise ValueError(
                f"tlt.drafter.buffer_max_bytes={max_bytes} cannot hold one row: a row of seq_len={s} (hidden size {d}, "
                f"{f.name}, top_k={k}, {num_feature_layers} feature layers) takes {self.row_bytes} bytes; set "
                f"tlt.drafter.buffer_max_bytes >= {self.row_bytes}, or lower tlt.drafter.seq_len.")
        self._max_rows = max_bytes // self.row_bytes
        self._replay_max_rows = self._max_rows // 2 if replay_share else 0
        self._max_rows -= self._replay_max_rows
        self._chunks: list[_Chunk] = []
        self._replay = self.empty_batch(0)  # the reservoir's rows
        self._draws = self._truncated = self._dropped_rows = self._evicted = 0

    # -- adding

    def add(self, rl_step: int, tokens_nT, prompt_lengths_n, response_lengths_n, hidden_nTD, ids_nTK, logp_nTK,
            layers_nTLD=None, observed_nT=None) -> None:
        """Packs the samples of a learner batch of RL step `rl_step` into rows and evicts.

        tokens_nT: prompt then response, right-padded to T. prompt_lengths_n (>= 1),
        response_lengths_n: per sample. hidden_nTD, ids_nTK / logp_nTK, layers_nTLD: the
        target's outputs at every token t (ids / logp: top-K of the distribution of token
        t+1), as `trainer.target_outputs` gives them; layers only for a fused drafter.
        observed_nT: bool [n, T], True at the tokens of an environment's observations
        (multi-turn; context, never targets); None: every response token is a target. Any
        array type numpy can read (device arrays are copied to host).
        """
        tokens_nT = np.asarray(tokens_nT)
        n, t = tokens_nT.shape
        p_n, r_n = np.asarray(prompt_lengths_n, np.int64), np.asarray(response_lengths_n, np.int64)
        if p_n.shape != (n,) or r_n.shape != (n,) or np.any(p_n < 1) or np.any(r_n < 0) or np.any(p_n + r_n > t):
            raise ValueError(f"Need prompt lengths >= 1 and response lengths >= 0 for each of the {n} samples, "
                             f"fitting T={t}; got {p_n.tolist()} and {r_n.tolist()}.")
        if observed_nT is not None and np.shape(observed_nT) != (n, t):
            raise ValueError(f"add: observed_nT is {np.shape(observed_nT)}; this batch is {(n, t)}.")
        if (layers_nTLD is None) != (not self.num_feature_layers):
            raise ValueError(f"add: layers {'missing' if layers_nTLD is None else 'given'}; this buffer was built "
                             f"with num_feature_layers={self.num_feature_layers}.")
        outputs = {"hidden": hidden_nTD, "ids": ids_nTK, "logp": logp_nTK, "layers": layers_nTLD}
        outputs = {k: np.asarray(x) for k, x in outputs.items() if x is not None}
        for name, x in outputs.items():
            shape, dtype = self._fields[name]
            if x.shape != (n, t, *shape[1:]) or (name in ("hidden", "layers") and x.dtype != dtype):
                want = f"{dtype.name} " if name in ("hidden", "layers") else ""
                raise ValueError(f"add: {name} is {x.dtype.name} {x.shape}; this buffer expects "
                                 f"{want}{(n, t, *shape[1:])}.")
        if self._chunks and rl_step < self._chunks[-1].step:
            raise ValueError(f"add: RL step {rl_step} after step {self._chunks[-1].step}; steps only move forward.")

        keep = np.flatnonzero(r_n > 0)
        p_n, end_n = p_n[keep], (p_n + r_n)[keep]
        start_n = np.maximum(p_n - 1 - self.prompt_tail, 0)
        start_n = np.maximum(start_n, np.minimum(p_n - 1, end_n - self.seq_len))  # over-long: prompt context goes first
        stop_n = np.minimum(end_n, start_n + self.seq_len)  # then the end of the response
        self._truncated += int(np.sum(stop_n < end_n))
        spans = [(i, slice(a, b)) for i, a, b in zip(keep, start_n, stop_n)]
        packing = pack_spans(stop_n - start_n, self.seq_len)
        targets = [np.arange(s.start, s.stop) >= p for (_, s), p in zip(spans, p_n)]
        if observed_nT is not None:
            observed_nT = np.asarray(observed_nT, bool)
            targets = [target & ~observed_nT[i, s] for target, (i, s) in zip(targets, spans)]
        rows = packing.rows([tokens_nT[i, s] for i, s in spans], targets,
                            positions=[np.arange(s.start, s.stop) for _, s in spans])
        for name, x in outputs.items():
            rows[name] = packing.scatter([x[i, s] for i, s in spans], self._fields[name][1])
        if packing.num_rows:
            self._chunks.append(_Chunk(rl_step, rows))
        self._evict(rl_step)

    def _evict(self, rl_step: int) -> None:
        for chunk in self._chunks:
            if chunk.step <= rl_step - self.keep_steps:
                self._into_replay(chunk.rows)
        self._chunks = [c for c in self._chunks if c.step > rl_step - self.keep_steps]
        excess = self.num_rows - self._max_rows
        while excess > 0:
            oldest = self._chunks[0]
            if len(oldest) <= excess:
                self._into_replay(self._chunks.pop(0).rows)
                dropped = len(oldest)
            else:  # a copy, so that the dropped rows' memory is freed
                self._into_replay({k: v[:excess] for k, v in oldest.rows.items()})
                oldest.rows = {k: v[excess:].copy() for k, v in oldest.rows.items()}
                dropped = excess
            excess -= dropped
            self._dropped_rows += dropped

    def _into_replay(self, rows: dict) -> None:
        """Offers evicted rows to the reservoir: the i-th row ever evicted is kept with
        probability capacity / i, in place of a uniformly drawn one (Algorithm R), so the
        reservoir is a uniform sample of every evicted row."""
        capacity = self._replay_max_rows
        if not capacity:
            return
        rng = np.random.default_rng([self.seed, 1, self._evicted])
        # Until the reservoir is full every row is kept: one copy of them all, not one a row.
        fill = min(capacity - self.num_replay_rows, len(rows["tokens"]))
        if fill:
            self._replay = {k: np.concatenate([v, rows[k][:fill]]) for k, v in self._replay.items()}
            self._evicted += fill
        for r in range(fill, len(rows["tokens"])):
            self._evicted += 1
            slot = int(rng.integers(self._evicted))
            if slot < capacity:
                for k, v in self._replay.items():
                    v[slot] = rows[k][r]

    @property
    def num_replay_rows(self) -> int:
        return len(self._replay["tokens"])

    # -- reading

    def __len__(self) -> int:
        return self.num_rows

    @property
    def num_rows(self) -> int:
        return sum(len(c) for c in self._chunks)

    @property
    def num_truncated(self) -> int:
        """Samples cut to seq_len since construction (or since the run's start, restored)."""
        return self._truncated

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for c in self._chunks for v in c.rows.values())

    def ready(self, batch_size: int) -> bool:
        """Whether `sample(batch_size)` can draw: any row is held (with fewer rows than
        batch_size, all of them are drawn)."""
        return self.num_rows > 0

    def empty_batch(self, batch_size: int) -> dict:
        """A batch shaped like `sample`'s with nothing to train on (segment 0, mask False):
        what compiling a drafter step needs before any data exists."""
        return {k: np.zeros((batch_size,) + shape, dtype) for k, (shape, dtype) in self._fields.items()}

    def field_specs(self) -> dict:
        """name -> (shape, dtype) of each row field: `sample(b)[name]` is (b, *shape) of dtype."""
        return dict(self._fields)

    def sample(self, batch_size: int, rows: int | None = None) -> dict:
        """[rows, ...] arrays of every row field (rows: default batch_size): min(batch_size,
        rows held) rows drawn uniformly without replacement, then rows with nothing to
        train on (a row drawn twice would only weigh twice). The draw is a function of
        (seed, number of earlier draws, rows held). Raises when empty."""
        n = self.num_rows
        if not n:
            raise ValueError("The drafter buffer is empty; check ready() before sampling.")
        take = min(batch_size, n)
        rows = batch_size if rows is None else rows
        if rows < take:
            raise ValueError(f"sample(batch_size={batch_size}, rows={rows}) draws {take} rows; rows must hold them.")
        rng = np.random.default_rng([self.seed, self._draws])
        self._draws += 1
        out = self.empty_batch(rows)
        old = min(round(self.replay_share * take), self.num_replay_rows)
        if old:
            picked = rng.choice(self.num_replay_rows, old, replace=False)
            for k in out:
                out[k][take - old:take] = self._replay[k][picked]
        return self._gather(self._chunks, rng.choice(n, take - old, replace=False), out)

    def _gather(self, chunks: list[_Chunk], idx: np.ndarray, out: dict) -> dict:
        """Rows idx of `chunks`' rows laid end to end, into the first len(idx) rows of `out`."""
        starts = np.cumsum([0] + [len(c) for c in chunks])
        chunk_of = np.searchsorted(starts, idx, side="right") - 1
        for c, chunk in enumerate(chunks):
            at = np.flatnonzero(chunk_of == c)
            for k in out:
                out[k][at] = chunk.rows[k][idx[at] - starts[c]]
        return out

    def num_rows_of_step(self, rl_step: int) -> int:
        """Rows held of RL step `rl_step`."""
        return sum(len(c) for c in self._chunks if c.step == rl_step)

    def rows_of_step(self, rl_step: int, n: int) -> dict:
        """[n, ...] arrays of every row field: n rows of RL step `rl_step` spread evenly over
        those held (all of them, then rows with nothing to train on, when fewer are held;
        only such rows when none is). Draws nothing: `sample`'s sequence is unchanged."""
        held = [c for c in self._chunks if c.step == rl_step]
        out = self.empty_batch(n)
        total = sum(len(c) for c in held)
        if total:
            self._gather(held, np.unique(np.linspace(0, total - 1, min(n, total)).round().astype(np.int64)), out)
        return out

    def stats(self) -> dict:
        """rows, samples and RL steps held, their bytes, and since construction the samples
        truncated to seq_len and the rows dropped to respect max_bytes."""
        samples = sum(int(c.rows["segment_ids"].max(axis=1).sum()) for c in self._chunks)
        return {"rows": self.num_rows, "samples": samples, "steps": len({c.step for c in self._chunks}),
                "bytes": self.nbytes, "truncated": self.num_truncated, "dropped_rows": self._dropped_rows,
                "replay_rows": self.num_replay_rows}

    # -- checkpointing

    def state_dict(self) -> dict:
        """What resumes the buffer exactly: the rows ("rows": field -> [R, ...], "steps":
        int64 [R], their RL steps, oldest first; both absent when empty, as orbax saves no
        zero-size array), the draw counter (with the seed, the sampler's state) and the
        counters, as numpy arrays and ints that `checkpoint.Checkpointer` saves. About
        `nbytes` (<= max_bytes) + 8 bytes a row, concatenated here (a transient copy). Its
        shapes follow the rows held: restore it without a target, or with shapes recorded
        at save time."""
        state = {"draws": self._draws, "truncated": self._truncated, "dropped_rows": self._dropped_rows,
                 "evicted": self._evicted}
        if self.num_replay_rows:
            state["replay"] = {k: v.copy() for k, v in self._replay.items()}
        if self._chunks:
            state["rows"] = {k: np.concatenate([c.rows[k] for c in self._chunks]) for k in self._fields}
            state["steps"] = np.concatenate([np.full(len(c), c.step, np.int64) for c in self._chunks])
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restores a `state_dict` of a buffer built with the same arguments."""
        chunks = []
        if "rows" in state:
            rows, steps = state["rows"], np.asarray(state["steps"])
            if set(rows) != set(self._fields):
                raise ValueError(f"load_state_dict: fields {sorted(rows)}, this buffer has {sorted(self._fields)}.")
            rows = {k: np.asarray(rows[k], dtype) for k, (_, dtype) in self._fields.items()}
            for k, (shape, _) in self._fields.items():
                if rows[k].shape != (len(steps), *shape):
                    raise ValueError(f"load_state_dict: {k} is {rows[k].shape}, expected {(len(steps), *shape)}.")
            bounds = [0, *(np.flatnonzero(np.diff(steps)) + 1), len(steps)]
            # Copies, so that evicting a step frees its memory.
            chunks = [_Chunk(int(steps[a]), {k: v[a:b].copy() for k, v in rows.items()})
                      for a, b in zip(bounds, bounds[1:])]
        self._chunks = chunks
        self._draws, self._truncated = int(state["draws"]), int(state["truncated"])
        self._dropped_rows, self._evicted = int(state["dropped_rows"]), int(state.get("evicted", 0))
        self._replay = self.empty_batch(0)
        if "replay" in state:
            self._replay = {k: np.asarray(state["replay"][k], dtype).copy() for k, (_, dtype) in self._fields.items()}
