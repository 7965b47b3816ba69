"""What scores a sample: the verifiers (`verifiers`), the code reward (`code_reward`,
`code_tests`), the rewards by name (`registry`), a reward called so that one sample's
failure costs no other its score (`safe`), and scoring for the RL loop, in worker
processes, under deadlines, as samples finish decoding (`scoring`).

The names below are the package's public API; the modules hold the rest.
"""
from tlt_jax.rewards.code_reward import FORGEABLE_POLICIES, CodeReward
from tlt_jax.rewards.registry import REWARDS, SCORE_RANGE, get_reward, reward_from_config
from tlt_jax.rewards.safe import FailedSample, safe_rewards, safe_rewards_with_info
from tlt_jax.rewards.scoring import BatchScores, PendingBatch, Scorer
from tlt_jax.rewards.verifiers import (
                                       FORMAT_CREDIT,
                                       ExplainedScore,
                                       RewardFn,
                                       answer_correctness,
                                       extract_final_number,
                                       format_reward,
                                       gsm8k_correctness,
                                       is_well_formed,
                                       math_correctness,
                                       parse_answer,
                                       reasoning_gym_score,
                                       task_reward,
)

__all__ = ["FORGEABLE_POLICIES", "FORMAT_CREDIT", "REWARDS", "SCORE_RANGE", "BatchScores", "CodeReward",
           "ExplainedScore", "FailedSample", "PendingBatch", "RewardFn", "Scorer", "answer_correctness",
           "extract_final_number", "format_reward", "get_reward", "gsm8k_correctness", "is_well_formed",
           "math_correctness", "parse_answer", "reasoning_gym_score", "reward_from_config", "safe_rewards",
           "safe_rewards_with_info", "task_reward"]
