"""`nestling eval`: acceptance of an exported draft, by the reference decoder or the real vLLM engine."""

from __future__ import annotations

from pathlib import Path

from nestling.config import to_dict
from nestling import outdir
from nestling.errors import NestlingError
from nestling.inputs import refuse_remote
from nestling.evaluate.settings import EvalSettings, drafting_note, resolve
from nestling.evaluate.standard_error import plus_minus, ratio_standard_error
from nestling.manifest import MANIFEST, write_manifest
from nestling.progress import Progress, log


def _eos_ids(target: Path, tokenizer) -> list[int]:
    from transformers import GenerationConfig

    ids = set()
    try:
        g = GenerationConfig.from_pretrained(target).eos_token_id
        ids.update(g if isinstance(g, list) else [g] if g is not None else [])
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def batches(prompts: list[list[int]], size: int) -> list[list[int]]:
    """Prompt indices in batches of `size` (0 = one batch), longest first: prompts of like length share
    a batch, so little of it is padding."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    size = size or len(order) or 1
    return [order[i : i + size] for i in range(0, len(order), size)]


def run_reference(
    target: Path, draft_dir: Path, prompts: list[list[int]], s: EvalSettings, aux_layer_ids: list[int] | None = None
) -> dict:
    """The PyTorch reference decoder over all prompts, in batches (and the target alone for the baseline)."""
    import torch

    from nestling.evaluate.specdec import SpecDecoder, SpecStats, load_draft, target_generate_batch
    from nestling.targets.load import load_model, load_tokenizer

    s, _ = resolve(s)
    model = load_model(target, dtype=s.dtype, device=s.device)
    dtype = getattr(torch, s.dtype)
    draft = load_draft(draft_dir, model, dtype)
    eos = _eos_ids(target, load_tokenizer(target))
    dec = SpecDecoder(model, draft, s.k, s.temperature, eos, aux_layer_ids, s.draft_sample_method)
    total = SpecStats(s.k)
    outs: list[list[int]] = [[] for _ in prompts]
    forwards = [0] * len(prompts)
    base_outs: list[list[int]] = [[] for _ in prompts]
    base_s = 0.0
    # in tokens of the budget (prompts x max_new_tokens; a finished prompt spends its whole share), so
    # a batch that holds every prompt still reports its rate and a true ETA while it decodes
    prog = Progress("eval reference", total=len(prompts) * s.max_new_tokens, unit="tokens")
    for idx in batches(prompts, s.batch_size):
        group = [prompts[i] for i in idx]
        seeds = [s.seed + i for i in idx]
        before = prog.done

        def report(spent: int, before: int = before) -> None:
            prog.update(before + spent - prog.done)

        o, stats, seconds = dec.generate_batch(group, s.max_new_tokens, seeds, on_progress=report)
        for i, oi, st in zip(idx, o, stats):
            outs[i], forwards[i] = oi, st.target_forwards
            total.add(st)
        total.seconds += seconds
        if s.baseline:
            b, dt = target_generate_batch(model, group, s.max_new_tokens, s.temperature, eos, seeds)
            for i, bi in zip(idx, b):
                base_outs[i] = bi
            base_s += dt
        prog.update(before + len(idx) * s.max_new_tokens - prog.done, acc_len=total.acceptance_length)
    r = {
        "acceptance_length": total.acceptance_length,
        "per_position": total.per_position,
        "num_drafts": total.num_drafts,
        "num_draft_tokens": total.num_draft_tokens,
        "num_accepted_tokens": total.num_accepted_tokens,
        "accepted_per_pos": total.accepted_per_pos,
        "tokens": total.new_tokens,
        "seconds": total.seconds,
        "tokens_per_s": total.new_tokens / max(total.seconds, 1e-9),
        "target_forwards": total.target_forwards,
        "mean_tokens_per_target_forward": total.new_tokens / max(total.target_forwards, 1),
        "tokens_per_forward_se": ratio_standard_error([len(o) for o in outs], forwards),
        "forwards": forwards,
        "outputs": outs,
        "device": s.device,
        "dtype": s.dtype,
    }
    if s.baseline:
        r.update(_baseline(r, base_outs, base_s))
    return r


def _baseline(r: dict, base_outs: list[list[int]], base_s: float) -> dict:
    tokens = sum(map(len, base_outs))
    tps = tokens / max(base_s, 1e-9)
    out = {"baseline_tokens_per_s": tps, "speedup": r["tokens_per_s"] / max(tps, 1e-9), "baseline_outputs": base_outs}
    out["identical_share"] = sum(a == b for a, b in zip(r["outputs"], base_outs)) / max(len(base_outs), 1)
    return out


def run_vllm_engine(target: Path, draft_dir: Path, prompts: list[list[int]], s: EvalSettings) -> dict:
    from nestling.evaluate.vllm_engine import run_vllm

    # vLLM refuses a prompt longer than its context: grow the setting to fit the longest prompt.
    s, _ = resolve(s)
    need = max((len(p) for p in prompts), default=0) + s.max_new_tokens + s.k + 1
    res = run_vllm(
        target,
        draft_dir,
        prompts,
        s.k,
        s.max_new_tokens,
        s.temperature,
        s.dtype,
        max(s.max_model_len, need),
        s.seed,
        s.baseline,
        draft_sample_method=s.draft_sample_method,
    )
    d = res["drafts"][0]
    r = {
        k: d[k]
        for k in (
            "acceptance_length",
            "per_position",
            "num_drafts",
            "num_draft_tokens",
            "num_accepted_tokens",
            "accepted_per_pos",
            "outputs",
            "seconds",
            "tokens",
            "target_forwards",
            "forwards",
            "mean_tokens_per_target_forward",
            "tokens_per_forward_se",
        )
    }
    r["tokens_per_s"] = d["tokens"] / max(d["seconds"], 1e-9)
    if "baseline" in res:
        b = res["baseline"]
        r.update(_baseline(r, b["outputs"], b["seconds"]))
    return r


def draftable_share(draft_dir: Path, outputs: list[list[int]]) -> float:
    """The share of generated tokens inside the draft's vocabulary (`t2d`; a folder without one drafts the
    whole vocabulary): a token outside is never drafted, so this bounds what any draft step could accept."""
    from safetensors import safe_open

    with safe_open(str(draft_dir / "model.safetensors"), "pt") as f:
        if "t2d" not in f.keys():
            return 1.0
        t2d = f.get_tensor("t2d").bool()
    tokens = [t for o in outputs for t in o]
    return sum(bool(t2d[t]) for t in tokens) / max(1, len(tokens))


def evaluate(
    draft_dir: str | Path,
    target: str | Path,
    prompts: str | Path,
    out: str | Path,
    settings: EvalSettings | None = None,
) -> dict:
    """Evaluate `draft_dir` on `target` over `prompts`; writes report.json/.md, acceptance.png, manifest."""
    from nestling.export.run import check_draft_matches_target
    from nestling.targets.load import resolve_target

    s = settings or EvalSettings()
    if s.engine in ("vllm", "both"):
        from nestling.evaluate.vllm_sampling import check_vllm_sampling

        check_vllm_sampling(s.temperature)  # before anything is loaded or written
    refuse_remote(prompts, "prompts")  # a URL: never fetched
    draft_dir, out = Path(draft_dir), Path(out)
    target_dir = resolve_target(target)
    check_draft_matches_target(draft_dir, target_dir)
    inputs = [("draft folder", draft_dir), ("target", target_dir), ("target", target), ("prompts", prompts)]
    with outdir.claim(out, "eval", inputs):
        return _evaluate(draft_dir, target_dir, prompts, out, s)


def _engine_this_machine_serves(target_dir: Path, s: EvalSettings) -> EvalSettings:
    """vLLM where it can serve the draft beside this target, else the reference decoder, with a line
    that says why (targets/vllm_rules.py: the CPU build and MLA targets)."""
    import dataclasses
    import json

    import torch

    from nestling.targets.vllm_rules import eagle3_serving_limit, has_amx

    if s.engine not in ("vllm", "both"):
        return s
    config = json.loads((target_dir / "config.json").read_text())
    limit = eagle3_serving_limit(config, s.dtype, not torch.cuda.is_available(), has_amx())
    if limit is None:
        return s
    log(f"[eval] the reference decoder measures this draft instead of vLLM: {limit}")
    return dataclasses.replace(s, engine="reference")


def _evaluate(draft_dir: Path, target_dir: Path, prompts: str | Path, out: Path, s: EvalSettings) -> dict:
    from nestling.evaluate.prompts import fit_context, load_prompts
    from nestling.evaluate.report import write_report
    from nestling.evaluate.vllm_engine import CannotServe
    from nestling.targets.load import load_config, load_tokenizer, target_fingerprint

    tok = load_tokenizer(target_dir)
    config = load_config(target_dir)
    context = getattr(config.get_text_config(), "max_position_embeddings", None)
    ids = fit_context(load_prompts(prompts, tok, s.max_prompts), context, s.max_new_tokens + s.k + 1)
    s, notes = resolve(s)
    for note in notes:
        log(f"[eval] {note}")
    s = _engine_this_machine_serves(target_dir, s)
    drafting = drafting_note(s.temperature, s.draft_sample_method)
    log(f"[eval] {len(ids)} prompts, k={s.k}, engine={s.engine}, temperature={s.temperature}{drafting}")
    engines: dict[str, dict] = {}
    # vLLM first: it sizes its KV cache from the GPU memory free when it starts, which the reference
    # decoder's tensors in this process would hold (engine both on a GPU: vLLM's engine failed to start)
    if s.engine in ("vllm", "both"):
        try:
            engines["vllm"] = run_vllm_engine(target_dir, draft_dir, ids, s)
        except CannotServe as e:  # vLLM said so before loading anything: measure the draft all the same
            log(f"[eval] the reference decoder measures this draft instead of vLLM: {e}")
            engines["reference"] = run_reference(target_dir, draft_dir, ids, s)
    if s.engine in ("reference", "both") and "reference" not in engines:
        engines["reference"] = run_reference(target_dir, draft_dir, ids, s)
    engines = {name: engines[name] for name in ("reference", "vllm") if name in engines}  # the report's order
    for name, r in engines.items():
        r["draftable_share"] = draftable_share(draft_dir, r["outputs"])
        if not r.get("num_drafts"):
            raise NestlingError(
                f"eval ({name}): nothing was drafted over {len(ids)} prompt(s), so there is no acceptance to report; "
                "every generation ended before a draft step (the target stops at once, or the prompts fill the "
                "context): check the prompts file and max_new_tokens / max_model_len"
            )
    report = {
        "draft": str(draft_dir),
        "target": str(target_dir),
        "k": s.k,
        "num_prompts": len(ids),
        "max_new_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "settings": to_dict(s),
        "engines": engines,
    }
    (out / MANIFEST).unlink(missing_ok=True)  # an earlier report's: incomplete until the new one is written
    write_report(report, out)
    for name, r in engines.items():
        log(
            f"[eval] {name}: acceptance length {r['acceptance_length']:.3f}, "
            f"{plus_minus(r['mean_tokens_per_target_forward'], r.get('tokens_per_forward_se'))} tokens per target "
            "forward, per position "
            f"{', '.join(f'{p:.2f}' for p in r['per_position'])}, {r['tokens_per_s']:.1f} tok/s; "
            f"{100 * r['draftable_share']:.1f}% of the generated tokens are in the draft vocabulary"
        )
    write_manifest(
        out,
        "eval",
        to_dict(s),
        inputs={"target": target_fingerprint(target_dir), "draft": str(draft_dir)},
        summary={n: {"acceptance_length": r["acceptance_length"]} for n, r in engines.items()},
    )
    return report
