"""Do two systems' greedy outputs agree? Token by token, per request."""
from __future__ import annotations

from typing import Any


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare_outputs(jax_out: list[list[int]], ref_out: list[list[int]],
                    first_k: int = 16) -> dict[str, Any]:
    """Per request, the tokens both produced are compared (min of the two lengths).

    `all_agree` is every request identical. In float32 the two should agree exactly;
    in bf16 a near-tie can flip one argmax and everything after it differs, so the
    rates (whole requests, first `first_k` tokens, tokens before the first
    divergence) say how close the systems are without failing the run.
    """
    if len(jax_out) != len(ref_out):
        raise ValueError(f"{len(jax_out)} jaxserve outputs vs {len(ref_out)} reference outputs")
    identical = agree_k = prefix_tokens = compared_tokens = 0
    first_mismatch = None
    for i, (a, b) in enumerate(zip(jax_out, ref_out)):
        n = min(len(a), len(b))
        p = common_prefix(a[:n], b[:n])
        identical += p == n
        agree_k += p >= min(first_k, n)
        prefix_tokens += p
        compared_tokens += n
        if p < n and first_mismatch is None:
            first_mismatch = {"request": i, "position": p, "jaxserve": a[p], "reference": b[p],
                              "jaxserve_next": a[p:p + 8], "reference_next": b[p:p + 8]}
    num = len(jax_out)
    return {"num_requests": num, "identical_requests": identical,
            "all_agree": identical == num,
            "identical_rate": identical / num if num else None,
            "first_k": first_k, "first_k_agree": agree_k,
            "first_k_rate": agree_k / num if num else None,
            "tokens_compared": compared_tokens, "tokens_before_divergence": prefix_tokens,
            "token_rate": prefix_tokens / compared_tokens if compared_tokens else None,
            "first_mismatch": first_mismatch}


def summary(a: dict[str, Any]) -> str:
    text = (f"greedy outputs: {a['identical_requests']}/{a['num_requests']} requests identical, "
            f"{a['first_k_agree']}/{a['num_requests']} agree on the first {a['first_k']} tokens, "
            f"{a['tokens_before_divergence']}/{a['tokens_compared']} tokens before divergence")
    m = a["first_mismatch"]
    if m:
        text += (f"; first mismatch: request {m['request']} token {m['position']} "
                 f"(jaxserve {m['jaxserve']}, reference {m['reference']})")
    return text
