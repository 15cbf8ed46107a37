"""HardKuma gates (LycheeDecode section 3.2, appendix A) and the direct-optimization baseline.

Kumaraswamy(a, b) on (0, 1):  F(x) = 1 - (1 - x^a)^b,  inverse CDF s = (1 - u^(1/b))^(1/a).
HardKuma: stretch s to (p, q) = (-0.1, 1.1), clip to [0, 1]:  z = min(1, max(0, p + (q - p) s)).
  P(z = 0) = F(-p / (q - p)),  P(z = 1) = 1 - F((1 - p) / (q - p))
  E[||z||_0] = sum_i (1 - F(-p / (q - p); a_i, b_i))          (appendix A.3, eq. 20)
  E[z] = int_0^1 P(z > t) dt = int_0^1 (1 - F((t - p) / (q - p))) dt   (numerical, for the plot
         and the inference rule "retrieval iff E[z] > 0.5").
"""
import torch

P_LO, Q_HI = -0.1, 1.1


def kuma_cdf(x, a, b):
    """F(x; a, b) = 1 - (1 - x^a)^b for x in [0, 1]."""
    return 1.0 - (1.0 - x ** a) ** b


def p_nonzero(a, b, p=P_LO, q=Q_HI):
    """P(z != 0) = 1 - F(-p / (q - p)) = (1 - x0^a)^b, x0 = -p / (q - p)."""
    x0 = -p / (q - p)
    return (1.0 - x0 ** a) ** b


def p_one(a, b, p=P_LO, q=Q_HI):
    """P(z = 1) = 1 - F((1 - p) / (q - p))."""
    return 1.0 - kuma_cdf(torch.as_tensor((1.0 - p) / (q - p), dtype=a.dtype), a, b)


def expected_l0(a, b, p=P_LO, q=Q_HI):
    """Closed form of E[||z||_0] over the gates (appendix A.3)."""
    return p_nonzero(a, b, p, q).sum()


def sample(a, b, u=None, p=P_LO, q=Q_HI, eps=1e-6):
    """Reparameterized HardKuma sample z(a, b, u); u ~ U(0, 1) unless given."""
    if u is None:
        u = torch.rand_like(a)
    u = u.clamp(eps, 1.0 - eps)
    # s = (1 - u^(1/b))^(1/a), in log space: log s = log(1 - exp(log(u) / b)) / a
    log_s = torch.log((-torch.expm1(torch.log(u) / b)).clamp(min=1e-30)) / a
    s = torch.exp(log_s)
    return (p + (q - p) * s).clamp(0.0, 1.0)


def expected_z(a, b, p=P_LO, q=Q_HI, n=513):
    """E[z] by the trapezoid rule on int_0^1 P(z > t) dt (error ~1e-6 for moderate a, b)."""
    t = torch.linspace(0.0, 1.0, n, dtype=a.dtype, device=a.device)
    x = (t - p) / (q - p)                       # in (x0, x1) inside (0, 1)
    surv = (1.0 - x[:, None] ** a[None, :]) ** b[None, :]  # P(z > t) = 1 - F(x)
    return torch.trapezoid(surv, t, dim=0)


class HardKumaGates(torch.nn.Module):
    """One HardKuma gate per head; log a and log b are the parameters (a = b = 1 at start)."""

    kind = "hardkuma"

    def __init__(self, n, init_a=1.0, init_b=1.0):
        super().__init__()
        self.log_a = torch.nn.Parameter(torch.full((n,), float(init_a)).log())
        self.log_b = torch.nn.Parameter(torch.full((n,), float(init_b)).log())

    def ab(self):
        return self.log_a.clamp(-7, 7).exp(), self.log_b.clamp(-7, 7).exp()

    def sample(self):
        a, b = self.ab()
        return sample(a, b)

    def expected_l0(self):
        a, b = self.ab()
        return expected_l0(a, b)

    @torch.no_grad()
    def expectation(self):
        a, b = self.ab()
        return expected_z(a.double(), b.double()).float()

    def deterministic(self):
        """Inference rule: retrieval iff E[z] > 0.5."""
        return self.expectation() > 0.5


class DirectGates(torch.nn.Module):
    """DuoAttention-style baseline: a continuous gate g in [0, 1] per head, used as is in
    training (`z = g`), clamped to [0, 1] after each step, rounded at the end. Its
    "expected L0" is the L1 norm sum(g) (DuoAttention's regularizer)."""

    kind = "direct"

    def __init__(self, n, init=0.5):
        super().__init__()
        self.g = torch.nn.Parameter(torch.full((n,), float(init)))

    def sample(self):
        return self.g.clamp(0.0, 1.0)

    def expected_l0(self):
        return self.g.clamp(0.0, 1.0).sum()

    @torch.no_grad()
    def expectation(self):
        return self.g.clamp(0.0, 1.0).detach().float()

    @torch.no_grad()
    def project(self):
        self.g.clamp_(0.0, 1.0)

    def deterministic(self):
        return self.expectation() > 0.5
