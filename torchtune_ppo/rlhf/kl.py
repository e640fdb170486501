"""Per-token estimators of the KL divergence to the reference policy, from the sampled tokens'
logprobs: in the reward (:func:`kl_estimate`) and as a loss term (:func:`kl_loss_estimate`)."""

import torch

# Schulman's estimators of KL(pi || ref) from samples of pi (http://joschu.net/blog/kl-approx.html).
KL_ESTIMATORS = ("k1", "k2", "k3")

# In the loss also the straight-through ones: k1's or k3's value, k2's gradient (verl's "k1+", "k3+").
KL_LOSS_ESTIMATORS = (*KL_ESTIMATORS, "k1+", "k3+")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token KL estimate from the sampled tokens' logprobs, any shape, e.g. ``[b, T]``.

    - ``k1``: ``logp - ref`` (unbiased, can be negative; torchtune's and the default).
    - ``k2``: ``0.5 * (logp - ref) ** 2`` (biased, >= 0).
    - ``k3``: ``exp(ref - logp) - (ref - logp) - 1`` (unbiased, >= 0, low variance; verl's
      ``low_var_kl``, without its clamp).
    """
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k2":
        return 0.5 * (logprobs - ref_logprobs).pow(2)
    if estimator == "k3":
        # expm1, not exp(x) - 1: near the reference exp(x) - 1 cancels in float32 and bf16 and
        # can go negative where the value is ~x**2 / 2.
        log_ratio = ref_logprobs - logprobs
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"kl_estimator must be one of {list(KL_ESTIMATORS)}, got {estimator!r}")


def kl_loss_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL term of the loss, any shape (e.g. ``[C, K]`` packed reads); differentiable
    in ``logprobs``.

    ``k1``, ``k2``, ``k3`` are :func:`kl_estimate`'s, with their own gradients in ``logprobs``:
    ``1``, ``d`` and ``1 - exp(-d)`` for ``d = logp - ref``; ``k3``'s ``-d`` is clamped to
    ``[-20, 20]`` and its value to at most 10 (as verl's ``low_var_kl``), so that one token far
    from the reference can neither overflow ``exp`` nor dominate the loss (clamped: no gradient).
    ``k1+`` and ``k3+`` are straight-through: the value is ``k1``'s or ``k3``'s, the gradient
    ``k2``'s (``d``), as verl's ``kl_loss_type``.
    """
    base = estimator[:-1] if estimator.endswith("+") else estimator
    if base not in KL_ESTIMATORS or (estimator != base and base == "k2"):
        raise ValueError(f"loss.kl_estimator must be one of {list(KL_LOSS_ESTIMATORS)}, got {estimator!r}")

    def value(lp: torch.Tensor) -> torch.Tensor:
        if base != "k3":
            return kl_estimate(lp, ref_logprobs, base)
        log_ratio = (ref_logprobs - lp).clamp(-20.0, 20.0)
        return (torch.expm1(log_ratio) - log_ratio).clamp(max=10.0)

    if estimator == base:
        return value(logprobs)
    k2 = kl_estimate(logprobs, ref_logprobs, "k2")
    return k2 - k2.detach() + value(logprobs.detach())

