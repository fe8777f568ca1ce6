"""vLLM against nestling's reference decoder, from two `nestling eval --engine both` reports.

    python benchmarks/serve_compare.py GREEDY/report.json [SAMPLED/report.json]

Greedy report: does vLLM's output with the draft equal the target alone's on every prompt, do vLLM's
outputs equal the reference decoder's, and are vLLM's accepted counts per position equal to the reference
decoder's on the same prompts. Sampled report: tokens per target forward of each engine with its standard
error over the prompts, and their difference in standard errors (two samplers cannot agree token for token,
only in distribution). Prints the comparison as JSON.
"""

from __future__ import annotations

import json
import math
import sys


def compare(greedy: dict, sampled: dict | None) -> dict:
    v, r = greedy["engines"]["vllm"], greedy["engines"]["reference"]
    out: dict = {
        "greedy": {
            "prompts": len(v["outputs"]),
            "vllm_identical_to_target_alone": v.get("identical_share"),
            "vllm_equals_reference_outputs": sum(a == b for a, b in zip(v["outputs"], r["outputs"]))
            / max(len(r["outputs"]), 1),
            "accepted_per_pos": {"vllm": v["accepted_per_pos"], "reference": r["accepted_per_pos"]},
            "accepted_equal": v["accepted_per_pos"] == r["accepted_per_pos"],
            "tokens_per_target_forward": {
                "vllm": v["mean_tokens_per_target_forward"],
                "reference": r["mean_tokens_per_target_forward"],
            },
        }
    }
    if sampled is not None:
        sv, sr = sampled["engines"]["vllm"], sampled["engines"]["reference"]
        a, b = sv["mean_tokens_per_target_forward"], sr["mean_tokens_per_target_forward"]
        sa, sb = sv.get("tokens_per_forward_se") or 0.0, sr.get("tokens_per_forward_se") or 0.0
        out["sampled"] = {
            "vllm": [a, sa],
            "reference": [b, sb],
            "difference_in_se": (a - b) / math.sqrt(sa**2 + sb**2) if sa or sb else None,
        }
    return out


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if len(sys.argv) > 1 else 2)
    greedy = json.loads(open(sys.argv[1]).read())
    sampled = json.loads(open(sys.argv[2]).read()) if len(sys.argv) > 2 else None
    print(json.dumps(compare(greedy, sampled), indent=1))


if __name__ == "__main__":
    main()
