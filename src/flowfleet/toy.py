"""A 2-D Gaussian mixture whose flows are known in closed form (the DDM blog's toy).

Data x0 ~ sum_j pi_j N(mu_j, s_j^2 I). Under flowfleet's path x_t = (1-t) x0 + t eps,
    x_t | j ~ N((1-t) mu_j, v_j I),   v_j = (1-t)^2 s_j^2 + t^2,
    E[x0 | x_t, j]  = mu_j + (1-t) s_j^2 / v_j (x_t - (1-t) mu_j)
    E[eps | x_t, j] =          t        / v_j (x_t - (1-t) mu_j)
and the marginal velocity is u_t(x) = sum_j p(j | x_t) (E[eps | x_t, j] - E[x0 | x_t, j]).
Grouping components into clusters gives each cluster's own closed-form flow (an "ideal expert")
and the exact router p(k | x_t) = sum_{j in k} p(j | x_t), so paris Eq. 3 can be checked exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GaussianMixture:
    means: torch.Tensor  # [J, 2]
    stds: torch.Tensor  # [J]
    weights: torch.Tensor  # [J], sums to 1

    @staticmethod
    def default(dtype: torch.dtype = torch.float64) -> "GaussianMixture":
        """Six well-separated components on a ring, unequal weights and widths."""
        angles = torch.arange(6, dtype=dtype) * (2 * torch.pi / 6)
        means = 3.0 * torch.stack([angles.cos(), angles.sin()], dim=1)
        stds = torch.tensor([0.3, 0.4, 0.25, 0.35, 0.3, 0.45], dtype=dtype)
        weights = torch.tensor([0.1, 0.2, 0.15, 0.25, 0.1, 0.2], dtype=dtype)
        return GaussianMixture(means, stds, weights)

    def sample(self, n: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (x0 [n, 2], component id [n])."""
        comp = torch.multinomial(self.weights.float(), n, replacement=True, generator=generator)
        noise = torch.randn(n, 2, generator=generator, dtype=self.means.dtype)
        return self.means[comp] + self.stds[comp, None] * noise, comp

    def subset(self, components: list[int]) -> "GaussianMixture":
        """The mixture restricted to some components (renormalised): one cluster's data."""
        idx = torch.tensor(components)
        w = self.weights[idx]
        return GaussianMixture(self.means[idx], self.stds[idx], w / w.sum())

    def _component_terms(self, x: torch.Tensor, t: torch.Tensor):
        """log p(x_t, j) [B, J] and the per-component velocity [B, J, 2]."""
        t = t.to(x.dtype).reshape(-1, 1)  # [B, 1]
        var = (1 - t) ** 2 * self.stds[None] ** 2 + t**2  # [B, J]
        centre = (1 - t)[:, :, None] * self.means[None]  # [B, J, 2]
        diff = x[:, None, :] - centre  # [B, J, 2]
        log_p = (self.weights.log()[None] - diff.pow(2).sum(-1) / (2 * var) - torch.log(2 * torch.pi * var))
        e_x0 = self.means[None] + ((1 - t) * self.stds[None] ** 2 / var)[:, :, None] * diff
        e_eps = (t / var)[:, :, None] * diff
        return log_p, e_eps - e_x0

    def log_joint(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """log p(x_t = x, j) for each component, [B, J]."""
        return self._component_terms(x, t)[0]

    def velocity(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Closed-form marginal velocity u_t(x), [B, 2]."""
        log_p, v = self._component_terms(x, t)
        post = torch.softmax(log_p, dim=1)  # p(j | x_t)
        return (post[:, :, None] * v).sum(1)


def cluster_posterior(mix: GaussianMixture, clusters: list[list[int]], x: torch.Tensor, t: torch.Tensor):
    """Exact router p(k | x_t) [B, K] for a grouping of the mixture's components into clusters."""
    post = torch.softmax(mix.log_joint(x, t), dim=1)  # [B, J]
    return torch.stack([post[:, c].sum(1) for c in clusters], dim=1)
