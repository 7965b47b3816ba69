"""What a rollout engine is built with: its slots, cache length, chunk lengths, end tokens,
decode's weight layout and the speculative steps it runs (`RolloutConfig`)."""
from __future__ import annotations

import dataclasses

from tlt_jax.models.config import end_token_ids


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """num_slots: concurrent sequences per group. max_prompt_length: prompts are
    right-padded to it (one prefill shape). max_length: KV-cache slots per sequence
    (prompt plus generated tokens). steps_per_sync: decode steps per device loop."""

    num_slots: int = 8
    max_prompt_length: int = 64
    max_length: int = 512
    steps_per_sync: int = 16
    # Speculative steps per device loop: each commits several tokens per sequence, and
    # shorter speculative chunks let the tuner hear (and re-decide) more often in the tail.
    spec_steps_per_sync: int = 4
    # The tokens that end a sequence (finish reason "eos"): an id or several, as
    # ModelConfig.eos_token_id spells them; stored as a tuple (empty: none).
    eos_token_id: int | tuple[int, ...] | None = None
    # Decode's weight layout (see RolloutEngine._engine_layout): per layer, the layer loop
    # unrolled (transformer.unstack_layers: longer compiles, no per-step weight copies on
    # the GPU), and q/k/v and gate/up fused into one matmul each (fuse_projections; not
    # on a tensor axis that does not divide the kv heads). In bfloat16 the unrolled loop
    # lets XLA keep float32 across fused operations, so log-probs differ from a scanned
    # forward's by bfloat16 rounding (in float32 they agree to float32 rounding; figures in
    # docs/benchmarks.md, "Rollout engine: figures behind its rules").
    per_layer_weights: bool = True
    fused_projections: bool = True
    max_draft_depth: int = 8  # deepest speculative strategy this engine runs
    # One speculative step per host sync, its draft and verify phases timed apart;
    # otherwise up to steps_per_sync speculative steps run in one device loop.
    time_spec_phases: bool = False
    # A drafting strategy's chunk compiles on a thread of its own when the policy first
    # picks it, and plain decode runs in its place until the program is warm: the rollout
    # goes on rather than waiting for the compile (each strategy's first pick otherwise
    # stalls its group for a compile). The policy hears only chunks that ran its pick.
    background_compiles: bool = False
    # Attention reads the cache in buckets of slots (`kv_buckets`): a chunk reads the
    # smallest of kv_bucket, 2 kv_bucket, 4 kv_bucket, ... and max_length that holds every
    # live sequence and what a step adds to it (`Group.kv_bucket_for`), since a decode
    # step's cost grows with the slots it reads (docs/benchmarks.md, "Rollout engine:
    # figures behind its rules"). One compiled chunk per bucket; 0: always max_length.
    kv_bucket: int = 64
    # A refill prefills at least this many slot rows (padding rows write nothing): prefill
    # programs compile at min_refill_rows, twice that, ... rather than at 1, 2, 4, ..., for
    # a few padded prompts' prefill. The samples are the same whatever it is.
    min_refill_rows: int = 1
    # A stand-in for a bigger target in rollout alone: decode runs every MLP padded to
    # this many units whose weights are zero (transformer.pad_mlp), so the tokens are the
    # model's while each step reads weights several times the CPU's caches, as a GPU's
    # decode is bound by reading its weights. Prefill, bound by compute on both, reads the
    # model's own units; the learner trains the model as it is. 0: the model's own width.
    decode_mlp_size: int = 0
    # Speculative steps emit exactly the tokens plain decode would draw with the same
    # keys (`speculative.coupled_verify`): the samples, and so an RL run, do not depend on
    # whether or with which drafter a chunk speculated, at an acceptance per drafted token
    # at most rejection sampling's (docs/speculative.md: within noise of it with the shipped
    # drafter). For comparing drafters on one trajectory of the policy.
    spec_coupled: bool = False

    def __post_init__(self):
        object.__setattr__(self, "eos_token_id", end_token_ids(self.eos_token_id))
        if self.max_prompt_length >= self.max_length:
            raise ValueError(f"max_prompt_length={self.max_prompt_length} must be below "
                             f"max_length={self.max_length} (the KV cache holds prompt and answer).")
        if min(self.num_slots, self.steps_per_sync, self.spec_steps_per_sync, self.max_prompt_length,
               self.min_refill_rows) < 1:
            raise ValueError("num_slots, steps_per_sync, spec_steps_per_sync, max_prompt_length and min_refill_rows "
                             "must be positive.")
        if self.kv_bucket < 0:
            raise ValueError(f"kv_bucket={self.kv_bucket} must be >= 0 (0: attention reads all max_length slots).")
        if self.decode_mlp_size < 0:
            raise ValueError(f"decode_mlp_size={self.decode_mlp_size} must be >= 0 (0: the model's own MLP width).")

    @property
    def kv_buckets(self) -> tuple[int, ...]:
        """The numbers of cache slots a chunk's attention may read, ascending."""
        sizes, n = [], self.kv_bucket
        while 0 < n < self.max_length:
            sizes.append(n)
            n *= 2
        return (*sizes, self.max_length)

    def step_reach(self, strategy, speculative: bool) -> int:
        """The most cache slots past a live sequence's length that one decode step (plain:
        strategy None) writes or reads: the tokens it commits, then the widest forward
        past them (a draft tree's nodes, the drafter's catch-up over its pending entries,
        an EAGLE tree's fed levels). A chunk runs a step only while every active sequence
        has that many attended slots left (`steps.chunk`)."""
        pending = self.max_draft_depth + 1 if speculative else 0
        if strategy is None:
            return 1 + pending
        widest = max(strategy.num_tree_nodes, pending, strategy.topk * strategy.depth)
        return strategy.depth + 1 + widest
