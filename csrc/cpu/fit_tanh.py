"""Fits the rational approximation of tanh that row_ops.h's softcap evaluates, and prints its
coefficients as C++ (the header's constants are this script's output; needs numpy):

    tanh(y) ~= y * P(y^2) / Q(y^2),  |y| <= Y_MAX (beyond, tanh(y) rounds to +-1 in fp32)

P and Q of degree 4 in y^2, Q(0) = 1, minimising the largest relative error over (0, Y_MAX]:
linearised least squares (Sanathanan-Koerner: each pass divides the residual by the previous
denominator) with Lawson's reweighting towards the minimax. Evaluated in fp32 with FMA (row_ops.h)
the result is within a few ulp of tanh; at the level of attention outputs it is as accurate as
PyTorch's own fp32 tanh (tests/test_variants.py).

    python csrc/cpu/fit_tanh.py
"""
import numpy as np

DEG_P, DEG_Q = 4, 4
Y_MAX = 9.0  # tanh(9) = 1 - 3e-8: 1.0f after rounding


def fit(deg_p=DEG_P, deg_q=DEG_Q, y_max=Y_MAX, passes=60):
    # dense where the error oscillates fastest (both ends)
    y = np.unique(np.concatenate([np.linspace(1e-6, y_max, 20000),
                                  y_max * np.cos(np.linspace(0, np.pi / 2, 20000))]))
    y = y[y > 0]
    f, t = np.tanh(y) / y, y * y
    weight, q_prev = np.ones_like(y), np.ones_like(y)
    best = None
    for _ in range(passes):
        a = np.hstack([t[:, None] ** np.arange(deg_p + 1),
                       -f[:, None] * t[:, None] ** np.arange(1, deg_q + 1)])
        w = weight / (np.abs(q_prev) * f)
        sol = np.linalg.lstsq(a * w[:, None], f * w, rcond=None)[0]
        p, q = sol[:deg_p + 1], np.concatenate([[1.0], sol[deg_p + 1:]])
        q_prev = np.polyval(q[::-1], t)
        err = (np.polyval(p[::-1], t) / q_prev - f) / f
        worst = np.abs(err).max()
        if best is None or worst < best[0]:
            best = (worst, p, q)
        weight = weight * np.sqrt(np.abs(err) / worst) + 1e-12
        weight *= len(weight) / weight.sum()
    return best


def main():
    worst, p, q = fit()
    print(f"// tanh(y) ~= y P(y^2) / Q(y^2) on |y| <= {Y_MAX}: max relative error {worst:.2e} "
          "(exact arithmetic)")
    for name, c in (("kTanhP", p), ("kTanhQ", q)):
        body = ", ".join(f"{np.float32(x)!r}f".replace("np.float32(", "").replace(")", "")
                         for x in c)
        print(f"constexpr float {name}[{len(c)}] = {{{body}}};")


if __name__ == "__main__":
    main()
