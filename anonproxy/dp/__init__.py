"""Differential privacy in the proxy.

The noise mechanisms (exact samplers, calibration, DP quantiles; see
docs/mechanisms.md) are re-exported here. Other modules of this package are
imported by their own names.
"""

from anonproxy.dp.mechanisms import (
    NoisyValue,
    bernoulli_exp,
    discrete_gaussian,
    discrete_gaussian_halfwidth,
    discrete_gaussian_stddev,
    discrete_laplace,
    discrete_laplace_halfwidth,
    discrete_laplace_stddev,
    gaussian_mechanism,
    gaussian_sigma2,
    laplace_mechanism,
    laplace_scale,
    noisy_sum_fixed_point,
)
from anonproxy.dp.quantiles import dp_quantile, quantile_mechanism

__all__ = [
    "NoisyValue",
    "bernoulli_exp",
    "discrete_gaussian",
    "discrete_gaussian_halfwidth",
    "discrete_gaussian_stddev",
    "discrete_laplace",
    "discrete_laplace_halfwidth",
    "discrete_laplace_stddev",
    "dp_quantile",
    "gaussian_mechanism",
    "gaussian_sigma2",
    "laplace_mechanism",
    "laplace_scale",
    "noisy_sum_fixed_point",
    "quantile_mechanism",
]
