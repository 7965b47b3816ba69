"""Speculative decoding: draft a tree per sequence, verify it with one target forward, commit.

One speculative step, for all B slots at once (the rollout engine calls these):

  draft    an EAGLE drafter grows a chain (sampled from its processed distribution,
           so verification uses the draft probabilities) or an EAGLE-2 dynamic tree
           (top-k expansion of the best nodes by cumulative draft log-prob, the best
           T-1 kept: deterministic drafts); or the n-gram drafter proposes a trie.
  verify   the target runs the T tree tokens through `transformer.decode` with the
           ancestor mask, at positions n + depth; lossless rejection sampling
           (`pallas_kernels.spec_verify`) picks the accepted path and the next token,
           or, coupled (`coupled_verify`), the target draws after every node with the
           key plain decode would use there and a child is accepted iff it is that draw.
  commit   the accepted path's keys/values move to contiguous cache slots; the rest
           of the tree stays behind the committed length, invisible.

Drafter bookkeeping. The drafter's entry at position t reads (x_{t+1}, f_t), so it
lags the target: entries are `pending` until the drafter has run them. Invariant:
drafter cache length + pending count = target cache length. Each step appends its
committed tokens with the target features that predicted them; an EAGLE draft first
runs the pending entries (the catch-up), whose last output feature is the root's.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import spec_verify
from tlt_jax import sampling
from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import ModelConfig
from tlt_jax.rollout import ngram
from tlt_jax.rollout.history import HistoryStore

DRAFTERS = ("eagle", "ngram", "history")


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How one speculative step drafts (hashable: compiled once per strategy).

    drafter "eagle": topk 1 drafts a chain of `depth` tokens sampled from the drafter;
      topk > 1 grows an EAGLE-2 tree `depth` levels deep, expanding the `topk` best
      nodes per level by their top-`topk` children, and verifies the best `num_nodes`
      nodes (root included).
    drafter "ngram": up to `topk` matched continuations of `depth` tokens, as a trie.
    drafter "history": the same, searching also the prompt's earlier completions (after
      the sequence's own text and its siblings'): the policy's `history` store.
    """

    drafter: str = "eagle"
    depth: int = 4
    topk: int = 1
    num_nodes: int = 0

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            raise ValueError(f"Strategy.drafter must be one of {DRAFTERS}, got {self.drafter!r}.")
        if self.depth < 1 or self.topk < 1:
            raise ValueError(f"Strategy depth and topk must be >= 1, got {self.depth}, {self.topk}.")
        if not self.is_eagle_tree and self.num_nodes:
            raise ValueError(f"num_nodes applies to EAGLE trees (topk > 1) only; got {self.num_nodes} for a "
                             f"{self.drafter} strategy with topk {self.topk}.")
        if self.is_eagle_tree:
            most = 1 + self.topk + (self.depth - 1) * self.topk * self.topk
            if not 2 <= self.num_nodes <= most:
                raise ValueError(f"An EAGLE tree of depth {self.depth} and topk {self.topk} has at most {most} "
                                 f"candidate nodes; num_nodes must be in [2, {most}], got {self.num_nodes}.")

    @property
    def is_eagle_tree(self) -> bool:
        return self.drafter == "eagle" and self.topk > 1

    @property
    def num_tree_nodes(self) -> int:
        """The nodes of each draft tree the target verifies, the root included."""
        if self.drafter in ("ngram", "history"):
            return ngram.NgramConfig(depth=self.depth, branches=self.topk).num_nodes
        return self.num_nodes if self.is_eagle_tree else self.depth + 1

    @property
    def name(self) -> str:
        if self.drafter in ("ngram", "history"):
            return f"{self.drafter}-d{self.depth}-b{self.topk}"
        return f"eagle-d{self.depth}" + (f"-k{self.topk}-t{self.num_nodes}" if self.is_eagle_tree else "")

    @classmethod
    def from_name(cls, name: str) -> "Strategy":
        """The inverse of `name`: 'eagle-d4', 'eagle-d5-k3-t12', 'ngram-d4-b2' or 'history-d6-b3'."""
        kind, *parts = name.split("-")
        letters = {"eagle": "dkt", "ngram": "db", "history": "db"}.get(kind, "")
        fields = {p[0]: int(p[1:]) for p in parts if p[:1] and p[0] in letters and p[1:].isdigit()}
        if not letters or "d" not in fields or len(fields) != len(parts):
            raise ValueError(f"Cannot read strategy {name!r}; write e.g. eagle-d4, eagle-d5-k3-t12, ngram-d4-b2 or "
                             "history-d6-b3.")
        return cls(kind, depth=fields["d"], topk=fields.get("k", fields.get("b", 1)), num_nodes=fields.get("t", 0))


class Speculation(Protocol):
    """Picks the strategy of each rollout chunk (None: plain decode) and hears back how
    it went: the tokens committed by a chunk (plain: strategy None) that started with
    num_active sequences, and its wall time (never a chunk whose step compiled in that
    call). The adaptive tuner (`tuner.BucketedEpsilonGreedy`) is one, `FixedSpeculation`
    the simplest. A policy with history strategies also has `history`, the
    `history.HistoryStore` they search (and each generate adds its completions to)."""

    strategies: Sequence[Strategy]

    def strategy_for(self, num_active: int) -> Strategy | None: ...

    def chunk_floor(self, num_active: int) -> int:
        """The chunk chosen at num_active stops once fewer sequences than this are active,
        so the next chunk is chosen for the smaller batch."""
        ...

    def observe(self, strategy: Strategy | None, num_active: int, tokens: int, seconds: float) -> None: ...


@dataclasses.dataclass(frozen=True)
class FixedSpeculation:
    """One strategy, used whenever at most `max_active` sequences run (speculation pays
    only when decode is memory-bound: few sequences; TLT's threshold is 32)."""

    strategy: Strategy
    max_active: int = 32
    history: HistoryStore | None = dataclasses.field(default=None, compare=False)  # for a history strategy

    @property
    def strategies(self) -> tuple[Strategy, ...]:
        return (self.strategy,)

    def strategy_for(self, num_active: int) -> Strategy | None:
        return self.strategy if num_active <= self.max_active else None

    def chunk_floor(self, num_active: int) -> int:
        return self.max_active + 1 if num_active > self.max_active else 0  # speculate once the batch drains

    def observe(self, strategy: Strategy | None, num_active: int, tokens: int, seconds: float) -> None:
        del strategy, num_active, tokens, seconds


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftTree:
    tokens: jax.Array  # [B, T] int32, node 0 the root (the last sampled token)
    parents: jax.Array  # [B, T] int32, -1 for the root and for padding nodes
    draft_logp: jax.Array | None  # [B, T, V] float32 when drafts were sampled, else None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DrafterState:
    """The drafter's side of B slots. P = pending capacity (deepest strategy + 1)."""

    cache: tfm.KVCache
    pending_tokens: jax.Array  # [B, P] x_{t+1} of entries not yet run
    pending_features: jax.Array  # [B, P, D] f_t of those entries
    pending_count: jax.Array  # [B]

    @property
    def capacity(self) -> int:
        return self.pending_tokens.shape[1]


@dataclasses.dataclass(frozen=True)
class Drafter:
    """A trained EAGLE drafter bound to its target (static: target and drafter configs)."""

    target_config: ModelConfig
    config: drafter_lib.DrafterConfig

    def init_state(self, batch_size: int, max_length: int, capacity: int) -> DrafterState:
        d = self.target_config.hidden_size
        dtype = self.target_config.jnp_dtype
        zeros = jnp.zeros((batch_size,), jnp.int32)
        return DrafterState(drafter_lib.init_cache(self.target_config, self.config, batch_size, max_length),
                            jnp.zeros((batch_size, capacity), jnp.int32),
                            jnp.zeros((batch_size, capacity, d), dtype), zeros)

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose outputs the features need (EAGLE-3 fusion)."""
        return self.config.feature_layers

    def features(self, drafter_params, h_xD, layers_nxD=None):
        return drafter_lib.target_features(drafter_params, self.config, h_xD, layers_nxD)

    def _decode(self, drafter_params, target_params, cache, tokens, features, positions, mask=None,
                return_logits=True):
        return drafter_lib.decode(drafter_params, target_params, self.target_config, self.config, cache, tokens,
                                  features, positions, mask_BTW=mask, return_logits=return_logits)

    def catch_up(self, drafter_params, target_params, state: DrafterState):
        """Runs the pending entries; returns (state with none pending, logits_BV and g_BD of
        the last one: the drafter's prediction after the newest committed token)."""
        b, p = state.pending_tokens.shape
        start = state.cache.lengths
        positions = start[:, None] + jnp.arange(p, dtype=jnp.int32)[None]
        g, cache = self._decode(drafter_params, target_params, state.cache, state.pending_tokens,
                                state.pending_features, positions, return_logits=False)
        last = jnp.maximum(state.pending_count - 1, 0)[:, None, None]
        g_last = jnp.take_along_axis(g, last, axis=1)[:, 0]
        logits = tfm.logits_from_hidden(drafter_lib.model_params(drafter_params, target_params), self.target_config,
                                        g_last)
        cache = cache.with_lengths(start + state.pending_count)
        emptied = DrafterState(cache, state.pending_tokens, state.pending_features, jnp.zeros_like(start))
        return emptied, logits, g_last

    def append(self, drafter_params, target_params, state: DrafterState, tokens_BE, features_BED, count_B):
        """Adds up to E entries per row as pending; runs the pending ones first when they
        could overflow (rows with count 0 are left alone)."""
        e = tokens_BE.shape[1]
        if e > state.capacity:
            raise ValueError(f"{e} new drafter entries exceed the pending capacity {state.capacity}.")
        state = jax.lax.cond(jnp.any(state.pending_count + count_B > state.capacity),
                             lambda s: self.catch_up(drafter_params, target_params, s)[0], lambda s: s, state)
        b = tokens_BE.shape[0]
        at = state.pending_count[:, None] + jnp.arange(e, dtype=jnp.int32)[None]
        at = jnp.where(jnp.arange(e)[None] < count_B[:, None], at, state.capacity)  # out of range: dropped
        rows = jnp.arange(b)[:, None]
        return DrafterState(state.cache,
                            state.pending_tokens.at[rows, at].set(tokens_BE, mode="drop"),
                            state.pending_features.at[rows, at].set(
                                features_BED.astype(state.pending_features.dtype), mode="drop"),
                            state.pending_count + count_B)

    def prefill_rows(self, drafter_params, target_params, state: DrafterState, rows_R, tokens_RP, features_RPD,
                     lengths_R) -> DrafterState:
        """Starts fresh slots (rows out of range are dropped) from their prompts: entry t
        reads tokens_RP[t] = x_{t+1} (the first sampled token at lengths-1) and f_t.
        All but the last entry are committed; the last stays pending."""
        r, p = tokens_RP.shape
        small = drafter_lib.init_cache(self.target_config, self.config, r, p, state.cache.k.dtype)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (r, p))
        _, small = self._decode(drafter_params, target_params, small, tokens_RP, features_RPD, positions,
                                return_logits=False)
        put = lambda a, v: a.at[rows_R].set(v, mode="drop")
        last = (lengths_R - 1)[:, None]
        last_token = jnp.take_along_axis(tokens_RP, last, 1)
        last_feature = jnp.take_along_axis(features_RPD, last[..., None], 1)
        cache = state.cache.with_rows(rows_R, small, lengths_R - 1)
        return DrafterState(cache, state.pending_tokens.at[rows_R, :1].set(last_token, mode="drop"),
                            state.pending_features.at[rows_R, :1].set(
                                last_feature.astype(state.pending_features.dtype), mode="drop"),
                            put(state.pending_count, jnp.ones_like(lengths_R)))

    def extend_rows(self, drafter_params, target_params, state: DrafterState, rows_R, tokens_RT, features_RTD,
                    counts_R) -> DrafterState:
        """Appends counts_R entries (entry t: tokens_RT[t] = x_{t+1} and f_t) to rows rows_R
        (out of range: dropped), as many as an observation holds, past the pending
        capacity: the rows' pending entries and the new ones run in one forward over their
        own cache rows, the last new entry left pending (a sample's next turn, extended in
        its slot with no re-prefill)."""
        b, p = state.pending_tokens.shape
        r, t = tokens_RT.shape
        rows = jnp.minimum(rows_R, b - 1)  # padding rows read a row, write nothing
        index = jnp.arange(r)[:, None]
        pending_R = state.pending_count[rows]
        at = pending_R[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # the new entries follow the pending
        tokens = jnp.pad(state.pending_tokens[rows], ((0, 0), (0, t))).at[index, at].set(tokens_RT)
        features = jnp.pad(state.pending_features[rows], ((0, 0), (0, t), (0, 0))).at[index, at].set(
            features_RTD.astype(state.pending_features.dtype))
        cache_R = state.cache.rows(rows)
        start_R = cache_R.lengths
        positions = start_R[:, None] + jnp.arange(p + t, dtype=jnp.int32)[None]
        _, cache_R = self._decode(drafter_params, target_params, cache_R, tokens, features, positions,
                                  return_logits=False)
        last = (pending_R + counts_R - 1)[:, None]
        cache = state.cache.with_rows(rows_R, cache_R, start_R + pending_R + counts_R - 1)
        put = lambda a, v: a.at[rows_R].set(v, mode="drop")
        return DrafterState(cache,
                            state.pending_tokens.at[rows_R, :1].set(jnp.take_along_axis(tokens, last, 1), mode="drop"),
                            state.pending_features.at[rows_R, :1].set(
                                jnp.take_along_axis(features, last[..., None], 1), mode="drop"),
                            put(state.pending_count, jnp.ones_like(counts_R)))

    # -- drafting --------------------------------------------------------------------------------

    def draft(self, drafter_params, target_params, state: DrafterState, root_B, strategy: Strategy,
              sp: sampling.SamplingParams, keys_BJ):
        """Returns (state, DraftTree). keys_BJ: [B, depth] the key each chain token is
        drawn with (trees draw nothing). The draft's own entries stay scratch in the cache."""
        state, logits, g = self.catch_up(drafter_params, target_params, state)
        if strategy.is_eagle_tree:
            tree = self._tree(drafter_params, target_params, state.cache, root_B, logits, g, strategy)
        else:
            tree = self._chain(drafter_params, target_params, state.cache, root_B, logits, g, strategy, sp, keys_BJ)
        return state, tree

    def _chain(self, drafter_params, target_params, cache, root_B, logits_BV, g_BD, strategy, sp, keys_BJ):
        b, d = root_B.shape[0], strategy.depth
        n = cache.lengths
        tokens, qs = [root_B], []
        for j in range(d):
            q = sampling.processed_logprobs(logits_BV, sp)
            token = jax.vmap(jax.random.categorical)(keys_BJ[:, j], q)
            tokens.append(token.astype(jnp.int32))
            qs.append(q)
            if j + 1 < d:
                scratch = cache.with_lengths(n)
                logits, g, cache = self._decode(drafter_params, target_params, scratch, tokens[-1][:, None],
                                                g_BD[:, None], (n + j)[:, None],
                                                jnp.ones((b, 1, j + 1), bool))
                logits_BV, g_BD = logits[:, 0], g[:, 0]
        qs.append(qs[-1])  # the leaf has no children: its row is never read
        parents = jnp.broadcast_to(jnp.arange(-1, d, dtype=jnp.int32), (b, d + 1))
        # Greedy drafts are deterministic: verifying them as such skips the [B, T, V] rows.
        return DraftTree(jnp.stack(tokens, 1), parents, None if sp.temperature == 0 else jnp.stack(qs, 1))

    def _tree(self, drafter_params, target_params, cache, root_B, logits_BV, g_BD, strategy):
        """EAGLE-2: candidates in level order (parents before children); scores are
        cumulative draft log-probs, which never increase along a path, so the best
        T-1 candidates are closed under taking parents."""
        b, k, depth, t = root_B.shape[0], strategy.topk, strategy.depth, strategy.num_nodes
        n = cache.lengths
        score, token = jax.lax.top_k(jax.nn.log_softmax(logits_BV), k)  # [B, k]
        cand_tokens, cand_scores = [token], [score]
        cand_parents = [jnp.full((b, k), -1, jnp.int32)]  # candidate index of the parent; -1 the root
        frontier = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))  # candidate ids to expand
        frontier_g = jnp.broadcast_to(g_BD[:, None], (b, k, g_BD.shape[-1]))
        fed_anc = jnp.zeros((b, k, 0), bool)  # [B, k, fed so far]: which fed slots each frontier node descends from
        num_cands = k
        for level in range(1, depth):
            fed_tokens = jnp.take_along_axis(jnp.concatenate(cand_tokens, 1), frontier, 1)
            mask = jnp.concatenate([fed_anc, jnp.broadcast_to(jnp.eye(k, dtype=bool), (b, k, k))], axis=2)
            logits, g, fed = self._decode(drafter_params, target_params, cache, fed_tokens, frontier_g,
                                          jnp.broadcast_to((n + level - 1)[:, None], (b, k)), mask)
            cache = fed.with_lengths(n)  # the fed levels stay scratch
            child_scores, child_tokens = jax.lax.top_k(jax.nn.log_softmax(logits), k)  # [B, k, k]
            child_scores = child_scores + jnp.take_along_axis(jnp.concatenate(cand_scores, 1), frontier, 1)[..., None]
            cand_tokens.append(child_tokens.reshape(b, k * k))
            cand_scores.append(child_scores.reshape(b, k * k))
            cand_parents.append(jnp.repeat(frontier, k, axis=1))
            # The next frontier: the best k new candidates; they see what their parent saw, plus it.
            best = jax.lax.top_k(child_scores.reshape(b, k * k), k)[1]
            parent_slot = best // k
            fed_anc = jnp.take_along_axis(mask, parent_slot[..., None], 1)
            frontier_g = jnp.take_along_axis(g, parent_slot[..., None], 1)
            frontier = num_cands + best
            num_cands += k * k
        tokens = jnp.concatenate(cand_tokens, 1)
        scores = jnp.concatenate(cand_scores, 1)
        parents = jnp.concatenate(cand_parents, 1)
        chosen = jnp.sort(jax.lax.top_k(scores, t - 1)[1], axis=1)  # level order kept
        node_of = jnp.full((b, num_cands), -1, jnp.int32).at[jnp.arange(b)[:, None], chosen].set(
            jnp.arange(1, t, dtype=jnp.int32))
        chosen_parent = jnp.take_along_axis(parents, chosen, 1)
        parent_node = jnp.where(chosen_parent < 0, 0,
                                jnp.take_along_axis(node_of, jnp.maximum(chosen_parent, 0), 1))
        return DraftTree(jnp.concatenate([root_B[:, None], jnp.take_along_axis(tokens, chosen, 1)], 1),
                         jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parent_node], 1), None)


def history_store(speculation) -> HistoryStore | None:
    """The store a policy's history strategies search; None without such a strategy."""
    if speculation is None or not any(s.drafter == "history" for s in speculation.strategies):
        return None
    return speculation.history


# The history strategies look up longer suffixes (the longest match wins, wherever it is):
# an earlier answer the sequence follows matches it over many tokens, a chance repeat of a
# few tokens in its own text over few.
HISTORY_MAX_NGRAM = 6


def ngram_tree(context_BS, context_length_B, group_B, strategy: Strategy, history_BH=None) -> DraftTree:
    """The n-gram (or, with history_BH [B, H], history) strategy's draft trees."""
    config = ngram.NgramConfig(depth=strategy.depth, branches=strategy.topk)
    if history_BH is not None:
        config = dataclasses.replace(config, max_ngram=HISTORY_MAX_NGRAM)
    tokens, parents = ngram.propose(context_BS, context_length_B, group_B, config, history_BH)
    return DraftTree(tokens, parents, None)


# ------------------------------------------------------------------------------------ verify


def ancestors(parents_BT: jax.Array) -> jax.Array:
    """[B, T, T] bool: node i sees node j iff j is i or one of its ancestors (padding
    nodes see only themselves). The transitive closure of "self or parent" by repeated
    squaring: ceil(log2 T) small matmuls, not a pass per node."""
    t = parents_BT.shape[1]
    anc = jnp.eye(t, dtype=jnp.int32) + jax.nn.one_hot(parents_BT, t, dtype=jnp.int32)  # -1: no row
    for _ in range(max(t - 1, 1).bit_length()):  # after k squarings: paths of length < 2^k
        anc = jnp.minimum(jnp.einsum("bij,bjk->bik", anc, anc), 1)
    return anc.astype(bool)


def depths(ancestors_BTT: jax.Array) -> jax.Array:
    """[B, T] int32: each node's depth below the root (from `ancestors`)."""
    return jnp.sum(ancestors_BTT, axis=2, dtype=jnp.int32) - 1


def bound_tree(tree: DraftTree, cache_length_B, max_length: int) -> DraftTree:
    """Pads out nodes whose cache slot would fall past the cache (children have larger
    indices, hence larger slots, than their parents: the tree stays closed)."""
    t = tree.parents.shape[1]
    fits = cache_length_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None] < max_length
    return DraftTree(tree.tokens, jnp.where(fits, tree.parents, -1), tree.draft_logp)


def verify_rows(tree: DraftTree, target_logp_BTV, keys_B, impl: str = "auto"):
    """`spec_verify.verify` with each row's own key, so a request's randomness does not
    depend on its slot or neighbours. Returns (path_BT, num_accepted_B, next_token_B)."""
    def one(tokens, parents, target, draft, key):
        out = spec_verify.verify(tokens[None], parents[None], target[None],
                                 None if draft is None else draft[None], key, impl=impl)
        return jax.tree.map(lambda a: a[0], out)

    if tree.draft_logp is None:
        return jax.vmap(lambda t, p, r, k: one(t, p, r, None, k))(tree.tokens, tree.parents, target_logp_BTV, keys_B)
    return jax.vmap(one)(tree.tokens, tree.parents, target_logp_BTV, tree.draft_logp, keys_B)


def coupled_verify(tree: DraftTree, target_logp_BTV, keys_BT):
    """Verification that emits exactly what plain decode would have drawn (rows for rows).

    keys_BT: the key of the token drawn after each node, the one plain decode would
    draw that position with. The target's draw after node i is categorical(keys_BT[:, i],
    target_logp_BTV[:, i]), as `sampling.sample` draws; the walk moves from the current
    node to its first child (in node order) whose token is that draw, and emits the
    current node's draw when there is none. Each emitted token is then the draw of plain
    decode at its position, whatever was drafted: lossless at any temperature, and the
    same samples with speculation on or off, with any drafter (up to the rounding by
    which a tree forward's logits differ from a one-token step's). A drafter that draws
    its tokens with the same keys (a shared Gumbel noise) proposes the target's draw
    whenever the two distributions put it first; per drafted token that accepts at most
    as often as rejection sampling (1 - total variation). Returns (path_BT, num_accepted_B, next_token_B) as
    `verify_rows`."""
    b, t = tree.tokens.shape
    draws_BT = jax.vmap(jax.vmap(jax.random.categorical))(keys_BT, target_logp_BTV).astype(jnp.int32)
    node_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    def body(i, carry):
        cur_B, n_acc_B, path_BT = carry
        draw_B = jnp.take_along_axis(draws_BT, cur_B[:, None], 1)[:, 0]
        accept_B = (tree.parents[:, i] == cur_B) & (tree.tokens[:, i] == draw_B)
        path_BT = jnp.where(accept_B[:, None] & (node_BT == n_acc_B[:, None]), i, path_BT)
        return jnp.where(accept_B, i, cur_B), n_acc_B + accept_B.astype(jnp.int32), path_BT

    zeros_B = jnp.zeros((b,), jnp.int32)
    cur_B, n_acc_B, path_BT = jax.lax.fori_loop(1, t, body, (zeros_B, zeros_B, jnp.full((b, t), -1, jnp.int32)))
    return path_BT, n_acc_B, jnp.take_along_axis(draws_BT, cur_B[:, None], 1)[:, 0]


def emitted(tree: DraftTree, target_logp_BTV, path_BT, num_accepted_B, next_token_B):
    """What one verify step emits, E = T entries per row (the first a+1 valid):
    (tokens_BE, logp_BE under the target's processed distribution, source nodes_BE:
    the node each emitted token was predicted after)."""
    b, t = tree.tokens.shape
    e = jnp.arange(t, dtype=jnp.int32)[None]
    nodes = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.maximum(path_BT[:, :t - 1], 0)], 1)
    path_tokens = jnp.take_along_axis(tree.tokens, jnp.maximum(path_BT, 0), 1)
    tokens = jnp.where(e < num_accepted_B[:, None], path_tokens, next_token_B[:, None])
    rows_logp = jnp.take_along_axis(target_logp_BTV, nodes[..., None], 1)
    logp = jnp.take_along_axis(rows_logp, tokens[..., None], 2)[..., 0]
    return tokens, logp, nodes


def commit_path(cache: tfm.KVCache, start_B, path_BT, keep_B) -> tfm.KVCache:
    """Moves the first keep_B accepted nodes' keys/values (tree slots start + node) to
    slots start+1 .. start+keep; lengths become start + 1 + keep (the root stays put)."""
    j = jnp.arange(path_BT.shape[1], dtype=jnp.int32)[None]
    src = start_B[:, None] + jnp.maximum(path_BT, 0)
    dst = jnp.where(j < keep_B[:, None], start_B[:, None] + 1 + j, cache.max_length)  # out of range: dropped
    return cache.with_slots_copied(src, dst, start_B + 1 + keep_B)
