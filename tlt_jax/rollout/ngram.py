"""Model-free n-gram drafter: propose draft trees by looking up the recent suffix.

The fallback drafter of speculative rollout. A sequence's last few tokens are searched
for in its own context and in the contexts of the other samples of the same prompt
(the G answers of a GRPO group share much text); the tokens that followed a match are
proposed as the draft. Everything is plain jnp with static shapes, so `propose` runs
on the device inside a jitted rollout step, vectorised over the B slots.

Matching, for row b with valid context c_b = context[b, :lengths[b]]:

- n runs from `max_ngram` down to `min_ngram`; the first n whose suffix c_b[-n:]
  occurs at a *site* wins. A site is an end position p in a row r of the same group
  (r == b included) with c_r[p-n+1 : p+1] == c_b[-n:] and p + 1 < lengths[r], so at
  least one token follows it. In row b itself this excludes the suffix matching itself;
  overlapping matches (as in a run of one token) are allowed.
- The continuation of a site is c_r[p+1 : p+1+depth], shorter where c_r ends.
- Sites are preferred in this order: row b itself, latest site first (largest p); then
  the other rows of the group by ascending row index, each latest site first.
- Branches are taken greedily in that order, skipping a site whose continuation is a
  prefix of (or equal to) one already taken, since it would add no node to the tree,
  until `branches` are taken or the sites run out. Only sites of the winning n count.
- With a history row (`history_BH`, the prompt's earlier completions separated by -1,
  `history.HistoryStore.row`), its positions are sites too, after every row of the
  group (latest site first): a site there needs the n tokens ending at it to equal the
  suffix (a -1 equals no token, so a match never crosses a separator), and its
  continuation stops before the next -1.

The taken continuations are merged into a trie: node 0 is the root (the latest token,
c_b[-1]); branch k's token at depth j sits at node 1 + k * depth + j unless an earlier
branch already holds the same prefix, in which case that node is shared and this one is
padding (parent -1). Rows with group -1 or length 0 match nothing, lend nothing, and
get an all-padding tree.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class NgramConfig:
    """Static drafter settings (hashable: a jit static argument).

    max_ngram / min_ngram: longest and shortest suffix looked up. depth: tokens proposed
    per branch. branches: 1 gives a chain; more give a trie of up to that many distinct
    continuations from distinct sites.
    """

    max_ngram: int = 3
    min_ngram: int = 1
    depth: int = 4
    branches: int = 1

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}.")
        if min(self.depth, self.branches) < 1:
            raise ValueError(f"depth and branches must be positive, got {self.depth}, {self.branches}.")

    @property
    def num_nodes(self) -> int:
        """T: nodes of a draft tree, root included."""
        return 1 + self.depth * self.branches


def _suffix_tokens(context_BS, lengths_B, max_ngram):
    """suffix_BN[b, k] = c_b[-1-k] for k < max_ngram (clipped where the row is shorter)."""
    S = context_BS.shape[1]
    back_BN = jnp.clip(lengths_B[:, None] - 1 - jnp.arange(max_ngram), 0, S - 1)
    return jnp.take_along_axis(context_BS, back_BN, axis=1)


def _suffix_match_lengths(context_BS, lengths_B, suffix_BN):
    """match_BRS[b, r, p]: how many of row b's last tokens (at most N) equal, in order,
    the tokens of row r ending at position p. Validity of p is not checked."""
    S = context_BS.shape[1]
    pos_S = jnp.arange(S)
    match_BRS = jnp.zeros((context_BS.shape[0],) * 2 + (S,), jnp.int32)
    still_BRS = jnp.ones_like(match_BRS, bool)
    # Walk backwards k tokens from both ends; a running product keeps memory at B*B*S.
    for k in range(suffix_BN.shape[1]):
        back_RS = jnp.roll(context_BS, k, axis=1)  # back_RS[r, p] = context[r, p - k]
        eq_BRS = (back_RS[None] == suffix_BN[:, k, None, None]) & (pos_S >= k) & (k < lengths_B)[:, None, None]
        still_BRS &= eq_BRS
        match_BRS += still_BRS
    return match_BRS


def _history_match_lengths(history_BH, lengths_B, suffix_BN):
    """match_BH[b, p]: how many of row b's last tokens equal, in order, those of its own
    history row ending at p (a separator stops the walk: it equals no token)."""
    H = history_BH.shape[1]
    pos_H = jnp.arange(H)
    match_BH = jnp.zeros(history_BH.shape, jnp.int32)
    still_BH = jnp.ones(history_BH.shape, bool)
    for k in range(suffix_BN.shape[1]):
        back_BH = jnp.roll(history_BH, k, axis=1)
        still_BH &= (back_BH == suffix_BN[:, k, None]) & (pos_H >= k) & (k < lengths_B)[:, None]
        match_BH += still_BH
    return match_BH


def _history_continuations(history_BH, depth):
    """(cont_BHD, len_BH): the up-to-`depth` tokens after position p of row b's history,
    as many as come before the next separator (or the row's end)."""
    H = history_BH.shape[1]
    pos_HD = jnp.arange(H)[:, None] + 1 + jnp.arange(depth)
    cont_BHD = history_BH[:, jnp.clip(pos_HD, 0, H - 1)]
    real_BHD = (cont_BHD >= 0) & (pos_HD < H)[None]
    len_BH = jnp.sum(jnp.cumprod(real_BHD.astype(jnp.int32), axis=2), axis=2)
    return cont_BHD, len_BH


def _continuations(context_BS, lengths_B, depth):
    """(cont_RSD, len_RS): the up-to-`depth` tokens following position p of row r, and
    how many of them lie inside the valid context (may be <= 0 for late p)."""
    S = context_BS.shape[1]
    pos_SD = jnp.arange(S)[:, None] + 1 + jnp.arange(depth)
    cont_RSD = context_BS[:, jnp.clip(pos_SD, 0, S - 1)]
    len_RS = jnp.minimum(depth, lengths_B[:, None] - 1 - jnp.arange(S))
    return cont_RSD, len_RS


def _select_branches(candidate_BC, priority_BC, cont_CD, len_C, branches, cont_BHD=None, len_BH=None):
    """Greedy pick, per row, of up to `branches` candidates by ascending priority, each
    adding a node: a candidate whose continuation is a prefix of a taken one is dropped.

    The C candidates of cont_CD / len_C are shared by every row; with cont_BHD / len_BH
    each row b has H more of its own, columns C.. of candidate_BC and priority_BC.
    Returns (cont_BKD, len_BK); len 0 marks a branch not taken.
    """
    num_shared, depth = cont_CD.shape
    big = jnp.iinfo(jnp.int32).max
    inside_CD = jnp.arange(depth) < len_C[:, None]
    if cont_BHD is not None:
        inside_BHD = jnp.arange(depth) < len_BH[..., None]
    alive_BC = candidate_BC
    conts, lens = [], []
    for _ in range(branches):
        pick_B = jnp.argmin(jnp.where(alive_BC, priority_BC, big), axis=1)
        shared_B = jnp.minimum(pick_B, num_shared - 1)
        cont_BD, len_B = cont_CD[shared_B], len_C[shared_B]
        if cont_BHD is not None:
            own_B = pick_B >= num_shared
            at_B1 = jnp.clip(pick_B - num_shared, 0, cont_BHD.shape[1] - 1)[:, None]
            cont_BD = jnp.where(own_B[:, None], jnp.take_along_axis(cont_BHD, at_B1[..., None], 1)[:, 0], cont_BD)
            len_B = jnp.where(own_B, jnp.take_along_axis(len_BH, at_B1, 1)[:, 0], len_B)
        len_B = jnp.where(alive_BC.any(axis=1), len_B, 0)
        same_prefix_BC = (jnp.all((cont_CD[None] == cont_BD[:, None]) | ~inside_CD, axis=2)
                          & (len_C <= len_B[:, None]))
        if cont_BHD is not None:
            same_prefix_BC = jnp.concatenate(
                [same_prefix_BC, jnp.all((cont_BHD == cont_BD[:, None]) | ~inside_BHD, axis=2)
                 & (len_BH <= len_B[:, None])], axis=1)
        alive_BC &= ~same_prefix_BC
        conts.append(cont_BD)
        lens.append(len_B)
    return jnp.stack(conts, axis=1), jnp.stack(lens, axis=1)


def _merge_into_trie(root_B, cont_BKD, len_BK):
    """Trie of the branches (see the module docstring for the node layout).

    Returns (tokens_BT, parents_BT) with T = 1 + K * D.
    """
    B, K, D = cont_BKD.shape
    inside_BKD = jnp.arange(D) < len_BK[..., None]
    # prefix_BKKD[b, k, k2, j]: branches k and k2 agree on (and both hold) depths 0..j.
    agree_BKKD = (cont_BKD[:, :, None] == cont_BKD[:, None]) & inside_BKD[:, :, None] & inside_BKD[:, None]
    prefix_BKKD = jnp.cumprod(agree_BKKD.astype(jnp.int32), axis=3).astype(bool)
    earlier_or_same_KK = jnp.arange(K)[None, :] <= jnp.arange(K)[:, None]
    owner_BKD = jnp.argmax(prefix_BKKD & earlier_or_same_KK[None, :, :, None], axis=2)  # first agreeing branch
    node_BKD = 1 + owner_BKD * D + jnp.arange(D)
    parent_BKD = jnp.concatenate([jnp.zeros((B, K, 1), jnp.int32), node_BKD[..., :-1]], axis=2)
    real_BKD = inside_BKD & (owner_BKD == jnp.arange(K)[:, None])
    tokens_BT = jnp.concatenate([root_B[:, None], jnp.where(real_BKD, cont_BKD, 0).reshape(B, K * D)], axis=1)
    parents_BT = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32),
                                  jnp.where(real_BKD, parent_BKD, -1).reshape(B, K * D)], axis=1)
    return tokens_BT.astype(jnp.int32), parents_BT.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="config")
def propose(context_BS: jax.Array, lengths_B: jax.Array, group_B: jax.Array,
            config: NgramConfig, history_BH: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Draft trees from n-gram lookup in each row's own and its group's contexts, then
    in its history row.

    context_BS: int32 [B, S], tokens of each slot in [0, lengths_B[b]) (prompt and
        generated, the latest sampled token last); later positions are ignored.
    lengths_B: int32 [B]. group_B: int32 [B], rows with the same id >= 0 share
        contexts; -1 marks an inactive slot.
    history_BH: optional int32 [B, H], row b's earlier completions of its prompt, -1
        between them and after the last (`history.HistoryStore.row`).
    Returns (tokens_BT, parents_BT), int32 [B, T] with T = config.num_nodes: node 0 is
    the latest token (parent -1), node i >= 1 has parent < i or is padding (parent -1,
    token 0); the children of a node carry distinct tokens.
    """
    B, S = context_BS.shape
    context_BS = context_BS.astype(jnp.int32)
    lengths_B = jnp.clip(lengths_B.astype(jnp.int32), 0, S)
    active_B = (group_B >= 0) & (lengths_B > 0)

    suffix_BN = _suffix_tokens(context_BS, lengths_B, config.max_ngram)
    match_BRS = _suffix_match_lengths(context_BS, lengths_B, suffix_BN)
    cont_RSD, len_RS = _continuations(context_BS, lengths_B, config.depth)
    # A lender shares an active row's group id, so it is in a group too (empty rows hold no site).
    same_group_BR = (group_B[:, None] == group_B[None, :]) & active_B[:, None]
    site_BRS = same_group_BR[..., None] & (len_RS > 0)[None]
    match_BC = jnp.where(site_BRS, match_BRS, 0).reshape(B, B * S)
    rows_B = jnp.arange(B)
    row_rank_BR = jnp.where(rows_B[:, None] == rows_B[None, :], 0, 1 + rows_B[None, :])
    priority_BC = (row_rank_BR[..., None] * S + (S - 1 - jnp.arange(S))).reshape(B, B * S)
    cont_BHD = len_BH = None
    if history_BH is not None:
        H = history_BH.shape[1]
        history_BH = history_BH.astype(jnp.int32)
        cont_BHD, len_BH = _history_continuations(history_BH, config.depth)
        match_BH = jnp.where(active_B[:, None] & (len_BH > 0), _history_match_lengths(history_BH, lengths_B, suffix_BN),
                             0)
        match_BC = jnp.concatenate([match_BC, match_BH], axis=1)
        # After every row of the group (ranks 0..B, each S positions), latest site first.
        history_priority_H = (B + 1) * S + (H - 1 - jnp.arange(H))
        priority_BC = jnp.concatenate([priority_BC, jnp.broadcast_to(history_priority_H, (B, H))], axis=1)
    ngram_B = match_BC.max(axis=1)
    candidate_BC = (match_BC == ngram_B[:, None]) & (ngram_B >= config.min_ngram)[:, None]
    cont_BKD, len_BK = _select_branches(candidate_BC, priority_BC, cont_RSD.reshape(B * S, config.depth),
                                        len_RS.reshape(B * S), config.branches, cont_BHD, len_BH)

    root_B = jnp.take_along_axis(context_BS, jnp.maximum(lengths_B - 1, 0)[:, None], axis=1)[:, 0]
    tokens_BT, parents_BT = _merge_into_trie(jnp.where(active_B, root_B, 0), cont_BKD, len_BK)
    return tokens_BT, parents_BT
