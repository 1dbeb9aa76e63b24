"""RL objectives and the policy update: advantages, losses, chunked log-probs, update step."""
from lrl.rl.advantages import ESTIMATORS, advantages
from lrl.rl.losses import (AGGREGATIONS, Denominators, LossConfig, combine_metrics,
                           loss_denominators, packed_policy_loss, policy_loss, token_weights)
from lrl.rl.logprobs import token_logprobs_and_entropy
