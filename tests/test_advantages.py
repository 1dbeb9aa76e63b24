"""GRPO-family advantage estimators against numbers worked out by hand."""
import numpy as np
import pytest

from lrl.rl import advantages


def test_grpo_uses_ddof1_std():
    # mean 0.5, deviations ±0.5, unbiased var = 4·0.25/3 = 1/3, std = 0.57735.
    a = advantages(np.array([[1.0, 0.0, 0.0, 1.0]]), "grpo", eps=0.0)
    np.testing.assert_allclose(a, [[0.8660254, -0.8660254, -0.8660254, 0.8660254]], rtol=1e-6)
    # eps enters the denominator: 0.5 / (0.57735 + 0.1).
    a = advantages(np.array([[1.0, 0.0, 0.0, 1.0]]), "grpo", eps=0.1)
    np.testing.assert_allclose(a[0, 0], 0.5 / (0.5773503 + 0.1), rtol=1e-6)


def test_grpo_constant_group_is_zero_not_nan():
    a = advantages(np.array([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]), "grpo")
    np.testing.assert_array_equal(a, np.zeros((2, 3)))


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_constant_groups_are_exactly_zero_for_any_reward_value(estimator):
    # 0.7 is no binary fraction: the float32 group mean of 16 copies rounds 1 ulp away from
    # it, and grpo divided that residual by a 1-ulp std (+ eps) into 0.106 per sample.
    values = np.float32([0.7, 0.1, 1 / 3, -2.3, 1e4 + 0.1, 0.3])
    for g in (2, 3, 5, 7, 16, 64):
        a = np.asarray(advantages(np.repeat(values[:, None], g, axis=1), estimator))
        np.testing.assert_array_equal(a, 0.0, err_msg=f"G={g}")
    # Mixed with informative groups, the constant ones still get exactly 0, and the others
    # what they get alone (grpo, dr_grpo, rloo are per group).
    mixed = np.float32([[0.7] * 4, [1.0, 0.0, 0.0, 1.0], [0.3] * 4])
    a = np.asarray(advantages(mixed, estimator))
    np.testing.assert_array_equal(a[[0, 2]], 0.0)
    assert np.all(a[1] != 0.0)
    if estimator != "reinforce_pp":
        np.testing.assert_array_equal(a[1], np.asarray(advantages(mixed[1:2], estimator))[0])


def test_dr_grpo_only_centres():
    a = advantages(np.array([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 1.0, 1.0]]), "dr_grpo")
    np.testing.assert_allclose(a, [[0.5, -0.5, -0.5, 0.5], [1.5, -0.5, -0.5, -0.5]], rtol=1e-6)


def test_rloo_leave_one_out():
    # Row 0: 1 - (0+0+1)/3 = 2/3, 0 - (1+0+1)/3 = -2/3. Row 1: 3 - 1 = 2, 1 - 5/3 = -2/3.
    a = advantages(np.array([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 1.0, 1.0]]), "rloo")
    np.testing.assert_allclose(a, [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [2.0, -2 / 3, -2 / 3, -2 / 3]],
                               rtol=1e-6)


def test_reinforce_pp_whitens_over_batch():
    # Centred per group: [[0.5, -0.5], [0, 0]]; batch mean 0; unbiased var = 0.5/3; std 0.408248.
    a = advantages(np.array([[1.0, 0.0], [2.0, 2.0]]), "reinforce_pp", eps=0.0)
    np.testing.assert_allclose(a, [[1.2247449, -1.2247449], [0.0, 0.0]], rtol=1e-6)
    # The whitening is over the batch, not the group: a shifted second group changes nothing,
    # a scaled one does.
    b = advantages(np.array([[1.0, 0.0], [7.0, 5.0]]), "reinforce_pp", eps=0.0)
    # Centred [[.5,-.5],[1,-1]]; mean 0; var = (0.25·2 + 1·2)/3 = 5/6.
    np.testing.assert_allclose(b, np.array([[0.5, -0.5], [1.0, -1.0]]) / np.sqrt(5 / 6), rtol=1e-6)


def test_reinforce_pp_token_whitens_over_tokens():
    # Centred per group: [[.5, -.5], [1, -1]], over 1, 3, 2, 2 tokens: N = 8, token mean
    # (.5 - 1.5 + 2 - 2) / 8 = -.125; deviations .625, -.375, 1.125, -.875; squares times tokens
    # .390625 + .421875 + 2.53125 + 1.53125 = 4.875; unbiased var 4.875 / 7 = .696429.
    r = np.array([[1.0, 0.0], [3.0, 1.0]])
    lengths = np.array([[1, 3], [2, 2]])
    a = advantages(r, "reinforce_pp_token", lengths_PG=lengths)
    want = np.array([[0.625, -0.375], [1.125, -0.875]]) / np.sqrt(4.875 / 7 + 1e-8)
    np.testing.assert_allclose(a, want, rtol=1e-6)
    # Sequence whitening weighs each sample once: another number.
    assert not np.allclose(advantages(r, "reinforce_pp", eps=0.0), want, rtol=1e-3)
    # Longer responses weigh more: making the negative sample of group 0 longer moves the mean.
    b = advantages(r, "reinforce_pp_token", lengths_PG=np.array([[1, 30], [2, 2]]))
    assert not np.allclose(a, b, rtol=1e-3)


def _verl_rpp_baseline(rewards_PG, lengths_PG):
    """verl's compute_reinforce_plus_plus_baseline_outcome_advantage, in torch: the group-
    centred score tiled over each response's tokens, then masked_whiten (masked mean, masked
    variance times n / (n - 1), (x - mean) * rsqrt(var + 1e-8))."""
    import torch
    r = torch.tensor(rewards_PG, dtype=torch.float64)
    scores = (r - r.mean(dim=1, keepdim=True)).reshape(-1)
    lengths = torch.tensor(lengths_PG).reshape(-1)
    mask = (torch.arange(int(lengths.max()))[None, :] < lengths[:, None]).double()
    values = scores[:, None] * mask
    n = mask.sum()
    mean = (values * mask).sum() / n
    var = (((values - mean) ** 2) * mask).sum() / n * n / (n - 1)
    white = (values - mean) * torch.rsqrt(var + 1e-8) * mask
    return (white.sum(dim=1) / lengths.double()).reshape(r.shape).numpy()  # one value a row


def test_reinforce_pp_token_equals_verl_on_random_batches():
    rng = np.random.RandomState(0)
    for trial in range(20):
        p, g = rng.randint(1, 9), rng.randint(2, 9)
        r = rng.randn(p, g).astype(np.float32) * rng.choice([0.01, 1.0, 100.0])
        r[rng.rand(p, g) < 0.3] = 1.0  # ties, as binary-ish rewards give
        lengths = rng.randint(1, 500, size=(p, g))
        want = _verl_rpp_baseline(r, lengths)
        got = np.asarray(advantages(r, "reinforce_pp_token", lengths_PG=lengths))
        informative = r.max(1) > r.min(1)
        # verl shifts an all-equal group by -mean/std too; lrl gives it exactly 0.
        np.testing.assert_allclose(got[informative], want[informative], rtol=2e-4, atol=2e-5,
                                   err_msg=f"trial {trial}")
        np.testing.assert_array_equal(got[~informative], 0.0)


def test_reinforce_pp_token_needs_lengths():
    with pytest.raises(ValueError, match=r"reinforce_pp_token needs lengths_PG"):
        advantages(np.zeros((2, 2)), "reinforce_pp_token")
    with pytest.raises(ValueError, match=r"lengths_PG.*\(3, 2\).*\(2, 2\)"):
        advantages(np.zeros((2, 2)), "reinforce_pp_token", lengths_PG=np.ones((3, 2)))
    with pytest.raises(ValueError, match=r"at least 2 response tokens"):
        advantages(np.array([[1.0, 0.0]]), "reinforce_pp_token", lengths_PG=np.array([[1, 0]]))


def test_errors_name_the_culprit():
    with pytest.raises(ValueError, match=r"G=1.*G >= 2"):
        advantages(np.zeros((4, 1)))
    with pytest.raises(ValueError, match=r"'ppo'.*grpo.*dr_grpo.*rloo.*reinforce_pp.*_token"):
        advantages(np.zeros((2, 2)), "ppo")
    with pytest.raises(ValueError, match=r"\[P, G\]"):
        advantages(np.zeros(4))
