"""RL objectives and the policy update: advantages, GAE, losses (policy and value), KL in the
reward, chunked log-probs, update step."""
from lrl.rl import registry
from lrl.rl.advantages import ESTIMATORS, advantages, group_advantages, remax
from lrl.rl.fused_head import fused_token_loss
from lrl.rl.gae import (WhitenStats, combine_stats, gae, gae_packed, outcome_token_rewards, whiten,
                        whiten_stats)
from lrl.rl.kl import kl_in_score, kl_penalty, segment_sums, sequence_kl, token_kl, update_kl_coef
from lrl.rl.logprobs import token_logprobs_and_entropy
from lrl.rl.losses import (AGGREGATIONS, Denominators, LossConfig, combine_metrics,
                           loss_denominators, packed_policy_loss, policy_loss, token_loss,
                           token_loss_aux, token_weights)
from lrl.rl.registry import register_estimator, register_policy_loss
from lrl.rl.optim import default_decay_mask, learning_rate, lr_schedule, make_optimizer
from lrl.rl.train import (TrainState, abstract_train_state, accumulate_and_apply,
                          init_train_state, make_init_fn, train_state_shardings)
from lrl.rl.update import logprobs, make_logprobs_fn, make_update_fn, update_step
from lrl.rl.values import packed_value_loss, value_loss
