"""Where a draft loses at a sampling temperature: its first draft position, teacher-forced.

    python benchmarks/draft_calibration.py --draft DRAFT --prompts FILE [--target T] [--max-prompts 12]
        [--max-new-tokens 256] [--text-temperatures 0 0.7] [--serve-temperatures 0.7 1.0]
        [--scales 0.8 0.9 1 1.1 1.2 1.5 2] [--out FILE]

For each text temperature the target answers the prompts (greedy at 0, else sampled with one seed per
prompt); then the target reads prompt and answer once, and the draft's first step reads the target's
states at every answer position, as the engine feeds it after each verification. Over those positions:
- greedy agreement: the draft's argmax is the target's (what a greedy engine accepts at position 1);
- at each serving temperature T and logit scale s, the expected acceptance of a draft token sampled
  from softmax(s * z / T) under rejection sampling, sum_x min(p_T(x), q(x)) (what vLLM's probabilistic
  drafts accept at position 1, the target's mass outside the draft vocabulary counting as a loss).

Two questions it answers: is the draft's distribution too flat or too sharp (a scale s != 1 that
accepts more would say so, and a logit scale at export would be a free gain), and how much harder the
contexts the target writes by sampling are than its greedy ones (greedy agreement on each text).
No engine: the target in transformers on this machine's device, the draft in nestling's own model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from nestling.draft.model import Eagle3Draft, SlotCache


def first_position_sums(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    draft_targets: torch.Tensor,
    serve_temperatures: list[float],
    scales: list[float],
) -> dict:
    """Sums over N positions (to add up over prompts): target logits [N, V] of the token the draft
    predicts, the draft's logits [N, Vd], the target id of each draft id [Vd] ->
    {"positions", "greedy": argmax agreements, "accept": {"T,s": sum of sum_x min(p_T, q_{T,s})}}."""
    greedy = (draft_targets[draft_logits.argmax(-1)] == target_logits.argmax(-1)).sum().item()
    accept = {}
    for t in serve_temperatures:
        p = torch.softmax(target_logits.float() / t, -1)[:, draft_targets]  # the draft vocabulary's rows
        for s in scales:
            q = torch.softmax(s * draft_logits.float() / t, -1)
            accept[f"{t:g},{s:g}"] = torch.minimum(p, q).sum().item()
    return {"positions": target_logits.shape[0], "greedy": greedy, "accept": accept}


@torch.no_grad()
def teacher_forced(
    model, draft: Eagle3Draft, prompt: list[int], answer: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's first-step logits at every drafted answer position and the target's logits of the
    token each predicts -> ([N, Vd], [N, V]). The draft at position t reads (token t+1, the target's
    aux states at t) and predicts token t+2, which the target predicts at t+1. The first answer token
    comes from the prefill, so drafting starts at t = len(prompt) - 1."""
    full = torch.tensor(prompt + answer, device=model.device)[None]
    L, P = full.shape[1], len(prompt)
    out = model(input_ids=full, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i] for i in draft.config.aux_layer_ids], -1)
    tokens = torch.cat([full[:, 1:], full[:, :1]], 1)  # the last column predicts past the answer: unused
    h = draft.step(
        tokens, draft.combine(aux.to(draft.fc.weight.dtype)), torch.arange(L, device=full.device)[None], SlotCache(L)
    )
    rows = torch.arange(P - 1, L - 2, device=full.device)
    return draft.logits(h)[0, rows].float(), out.logits[0, rows + 1].float()


def measure(model, draft: Eagle3Draft, prompts: list[list[int]], answers: list[list[int]], args) -> dict:
    """Every prompt's sums added up -> greedy agreement and acceptance per (T, s), as shares."""
    total: dict = {"positions": 0, "greedy": 0, "accept": {}}
    targets = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device))
    for p, a in zip(prompts, answers):
        if len(a) < 2:
            continue
        zq, zp = teacher_forced(model, draft, p, a)
        part = first_position_sums(zp, zq, targets.to(zq.device), args.serve_temperatures, args.scales)
        total["positions"] += part["positions"]
        total["greedy"] += part["greedy"]
        for key, v in part["accept"].items():
            total["accept"][key] = total["accept"].get(key, 0.0) + v
    n = max(total["positions"], 1)
    return {
        "positions": total["positions"],
        "greedy_agreement": total["greedy"] / n,
        "acceptance": {key: v / n for key, v in total["accept"].items()},
    }


def generate(model, prompts: list[list[int]], max_new: int, t: float, eos: list[int]) -> tuple[list[list[int]], float]:
    """The target's answers, prompt i sampled with seed i: all at once on a GPU; one prompt at a time on
    a CPU, where a batch pads every prompt to the longest and that padded prefill dominates."""
    from nestling.evaluate.specdec import target_generate_batch

    if model.device.type != "cpu":
        return target_generate_batch(model, prompts, max_new, t, eos, list(range(len(prompts))))
    runs = [target_generate_batch(model, [p], max_new, t, eos, [i]) for i, p in enumerate(prompts)]
    return [out[0] for out, _ in runs], sum(s for _, s in runs)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True, help="an exported draft folder")
    ap.add_argument("--prompts", required=True, help="JSONL of {messages} or {prompt} records")
    ap.add_argument("--target", default=None, help="the target folder (default: the embedded SmolLM2)")
    ap.add_argument("--max-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--text-temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--serve-temperatures", type=float, nargs="+", default=[0.7, 1.0])
    ap.add_argument("--scales", type=float, nargs="+", default=[0.8, 0.9, 1.0, 1.1, 1.2, 1.5, 2.0])
    ap.add_argument("--out", type=Path, default=None, help="also write the result here as JSON")
    args = ap.parse_args(argv)
    args.scales = sorted(set(args.scales) | {1.0})  # s = 1 is the draft as exported, the reference
    if any(t <= 0 for t in args.serve_temperatures):
        ap.error("--serve-temperatures must be > 0 (at 0 the greedy agreement is the figure)")

    from nestling.assets import smollm2_dir
    from nestling.evaluate.prompts import load_prompts
    from nestling.evaluate.specdec import load_draft
    from nestling.targets.load import load_model, load_tokenizer

    target = Path(args.target) if args.target else smollm2_dir()
    model = load_model(target, dtype="float32", device="cuda" if torch.cuda.is_available() else "cpu")
    tok = load_tokenizer(target)
    draft = load_draft(args.draft, model)
    prompts = load_prompts(args.prompts, tok, args.max_prompts)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    result: dict = {"draft": str(args.draft), "prompts": str(args.prompts), "texts": {}}
    for t in args.text_temperatures:
        answers, seconds = generate(model, prompts, args.max_new_tokens, t, eos)
        print(
            f"[calibration] text at temperature {t:g}: {sum(map(len, answers))} tokens in {seconds:.0f}s",
            file=sys.stderr,
            flush=True,
        )
        result["texts"][f"{t:g}"] = measure(model, draft, prompts, answers, args)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    for t, r in result["texts"].items():
        best = {
            T: max((v, key) for key, v in r["acceptance"].items() if key.startswith(f"{T:g},"))
            for T in args.serve_temperatures
        }
        line = ", ".join(
            f"T {T:g}: {r['acceptance'][f'{T:g},1']:.3f} at s = 1, best {v:.3f} at s = {key.split(',')[1]}"
            for T, (v, key) in best.items()
        )
        print(f"text {t}: {r['positions']} positions, greedy agreement {r['greedy_agreement']:.3f}; {line}")
    return result


if __name__ == "__main__":
    main()
