"""The eval report: JSON (everything), a Markdown table, a PNG of per-position acceptance."""

from __future__ import annotations

from pathlib import Path

from nestling.evaluate.settings import drafting_note
from nestling.evaluate.standard_error import plus_minus
from nestling.manifest import atomic_write_json


SE_NOTE = (
    "± is the standard error over the prompts: two drafts measured on the same prompts differ resolvably when "
    "they differ by more than about 2·sqrt(se1² + se2²) (conservative; docs/eval.md)."
)


def markdown(report: dict) -> str:
    rows = [
        "| engine | acceptance length | tokens per target forward ± s.e. | "
        + " | ".join(f"pos {i + 1}" for i in range(report["k"]))
        + " | tok/s draft | tok/s target alone | speedup | greedy identical | in draft vocabulary |",
        "|---|---|---|" + "---|" * report["k"] + "---|---|---|---|---|",
    ]
    for name, r in report["engines"].items():
        pos = " | ".join(f"{p:.3f}" for p in r["per_position"])
        same, inside = r.get("identical_share"), r.get("draftable_share")
        per_forward = r.get("mean_tokens_per_target_forward")  # absent from vLLM reports before it was counted
        tpf = "-" if per_forward is None else plus_minus(per_forward, r.get("tokens_per_forward_se"))
        rows.append(
            f"| {name} | {r['acceptance_length']:.3f} | {tpf} | "
            f"{pos} | {r['tokens_per_s']:.1f} | "
            f"{r.get('baseline_tokens_per_s', float('nan')):.1f} | {r.get('speedup', float('nan')):.2f} | "
            f"{'-' if same is None else f'{100 * same:.0f}%'} | "
            f"{'-' if inside is None else f'{100 * inside:.1f}%'} |"
        )
    head = (
        f"# nestling eval\n\ndraft `{report['draft']}` on target `{report['target']}`, k={report['k']}, "
        f"{report['num_prompts']} prompts, {report['max_new_tokens']} new tokens max, "
        f"temperature {report['temperature']}{_drafting(report)}\n\n"
    )
    notes = [identical_note(name, r) for name, r in report["engines"].items() if r.get("identical_share") is not None]
    if any(r.get("tokens_per_forward_se") is not None for r in report["engines"].values()):
        notes.insert(0, SE_NOTE)
    return head + "\n".join(rows) + "\n" + "".join(f"\n{n}\n" for n in notes if n)


def _drafting(report: dict) -> str:
    """How the draft proposed at a temperature (greedy, vLLM's default, in a report from before the
    setting), for the report's head."""
    method = (report.get("settings") or {}).get("draft_sample_method", "greedy")
    return drafting_note(report["temperature"], method)


def identical_note(engine: str, r: dict) -> str:
    """What the greedy-identical share says. The target decides every token, so a draft cannot change
    a greedy output: a share below 100% is the target's own logits moving with the forward's shape
    (verification runs K+1 tokens per forward, the target alone 1) and flipping near-ties."""
    share = r["identical_share"]
    n = len(r.get("baseline_outputs") or [])
    same = round(share * n)
    text = f"{engine}: greedy output identical to the target alone on {same} of {n} prompts ({100 * share:.0f}%)."
    if share >= 1.0:
        return text
    return text + (
        " A draft cannot change a greedy output (the target decides every token): the rest is the engine "
        "rounding differently when one forward verifies K+1 tokens than when it decodes one, which flips "
        "near-ties and lets the continuation part from there. bf16 does this; so do some CPUs' kernels. It says "
        "nothing about the draft; dtype=float32 narrows it, and acceptance is counted on what was decoded."
    )


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
    xs = list(range(1, report["k"] + 1))
    for name, r in report["engines"].items():
        ax.plot(xs, r["per_position"], marker="o", label=f"{name} (AL {r['acceptance_length']:.2f})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_xticks(xs)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "report.json", report)
    (out / "report.md").write_text(markdown(report))
    plot(report, out / "acceptance.png")
