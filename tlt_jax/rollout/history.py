"""Earlier rollouts of each prompt, kept on the host for the history drafter.

RL revisits its prompts (every epoch) and a policy's answers to one prompt repeat much of
their own text from step to step, so a prompt's earlier completions are drafts for free:
the history strategies (`Strategy("history", ...)`, named `history-d6-b3`) search them,
after the sequence's own text and its siblings', with the n-gram matcher
(`ngram.propose(..., history_BH=...)`), and verify what they find like any other draft.

Bounded memory: per prompt at most `max_tokens` tokens (each completion costs its tokens,
`lead_tokens` of the prompt before it and one separator; the oldest completions go first,
a completion longer than the whole budget is cut to its head), and every completion
recorded more than `keep_steps` steps before the current one is evicted, so only prompts
of the last `keep_steps` steps are held: at most
keep_steps x prompts per step x max_tokens tokens (4 bytes each; 4 MB for 1,000 prompts at
the default 1,024). A repeated completion is kept once, as its newest copy.

The device sees one row per slot, `row(prompt)`: int32 [max_tokens], the kept completions
oldest first, each as `prompt[-lead_tokens:] + completion` followed by -1 (the separator,
which no token equals, so a match or a continuation never crosses it), -1 after the last.
The matcher prefers later sites, so the newest completion is searched first. The lead
tokens let the first tokens of an answer match across the prompt's end.
"""
from __future__ import annotations

import collections
import threading
from typing import Iterable, Sequence

import numpy as np

SEPARATOR = -1
# The defaults: 256 steps cover an epoch of a GSM8K- or MATH-sized set (7.5k prompts) at 64
# prompts per step, so a prompt's answers are still there when the next epoch reaches it.
MAX_TOKENS, KEEP_STEPS, LEAD_TOKENS = 1024, 256, 3


class HistoryStore:
    """Earlier completions per prompt (keyed by the prompt's tokens). Thread-safe.

    max_tokens: the per-prompt budget and the width of `row` (the engine's per-slot
      history buffer: one static shape, so no step compiles anew).
    keep_steps: completions recorded at step s are evicted once `begin_step(t)` is called
      with t >= s + keep_steps.
    lead_tokens: prompt tokens kept before each completion.
    """

    def __init__(self, max_tokens: int = MAX_TOKENS, keep_steps: int = KEEP_STEPS, lead_tokens: int = LEAD_TOKENS):
        if max_tokens < 2 + lead_tokens:
            raise ValueError(f"max_tokens={max_tokens} must be at least lead_tokens + 2 = {lead_tokens + 2} (a token "
                             "and its separator after the lead).")
        if keep_steps < 1 or lead_tokens < 0:
            raise ValueError(f"keep_steps must be >= 1 and lead_tokens >= 0; got {keep_steps}, {lead_tokens}.")
        self.max_tokens, self.keep_steps, self.lead_tokens = int(max_tokens), int(keep_steps), int(lead_tokens)
        self.step = 0
        self._lock = threading.Lock()
        # Per prompt: kept tokens (lead, then the completion's head; int32 bytes, 4 per token) ->
        # the step recorded, oldest first.
        self._entries: dict[bytes, collections.OrderedDict[bytes, int]] = {}
        self._sizes: dict[bytes, int] = {}  # tokens of each prompt's row, separators included

    @staticmethod
    def _key(prompt: Sequence[int]) -> bytes:
        return np.asarray(prompt, np.int32).tobytes()

    def begin_step(self, step: int) -> None:
        """Makes `step` the current step (what `add` records under) and evicts every
        completion recorded at a step <= step - keep_steps."""
        with self._lock:
            self.step = int(step)
            oldest = self.step - self.keep_steps + 1
            for key in list(self._entries):
                entries = self._entries[key]
                for tokens in [t for t, s in entries.items() if s < oldest]:
                    del entries[tokens]
                    self._sizes[key] -= len(tokens) // 4 + 1
                if not entries:
                    del self._entries[key], self._sizes[key]

    def add(self, prompt: Sequence[int], completions: Iterable[Sequence[int]]) -> None:
        """Records completions of `prompt` at the current step (empty ones are skipped)."""
        lead = np.asarray(prompt, np.int32)[len(prompt) - min(self.lead_tokens, len(prompt)):]
        room = self.max_tokens - len(lead) - 1
        key = self._key(prompt)
        with self._lock:
            entries = self._entries.setdefault(key, collections.OrderedDict())
            size = self._sizes.get(key, 0)
            for completion in completions:
                if len(completion) == 0:
                    continue
                tokens = np.concatenate([lead, np.asarray(completion[:room], np.int32)])
                if tokens.min() < 0:
                    raise ValueError(f"Token ids must be non-negative (-1 separates completions); got {tokens[:8]}.")
                n, tokens = len(tokens), tokens.tobytes()
                if tokens in entries:  # kept once, as the newest
                    del entries[tokens]
                    size -= n + 1
                entries[tokens] = self.step
                size += n + 1
                while size > self.max_tokens:
                    size -= len(entries.popitem(last=False)[0]) // 4 + 1
            if entries:
                self._sizes[key] = size
            else:
                del self._entries[key]

    def row(self, prompt: Sequence[int]) -> np.ndarray:
        """int32 [max_tokens]: the prompt's kept completions in the layout of the module
        docstring (all -1 for a prompt never seen)."""
        out = np.full((self.max_tokens,), SEPARATOR, np.int32)
        with self._lock:
            at = 0
            for tokens in self._entries.get(self._key(prompt), ()):
                n = len(tokens) // 4
                out[at:at + n] = np.frombuffer(tokens, np.int32)
                at += n + 1
        return out

    def rows(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """int32 [len(prompts), max_tokens], `row` of each."""
        return np.stack([self.row(p) for p in prompts]) if prompts else np.zeros((0, self.max_tokens), np.int32)

    def num_completions(self, prompt: Sequence[int]) -> int:
        with self._lock:
            return len(self._entries.get(self._key(prompt), ()))

    @property
    def num_prompts(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def num_tokens(self) -> int:
        """Tokens held, separators included (what the rows of every prompt fill)."""
        with self._lock:
            return sum(self._sizes.values())
