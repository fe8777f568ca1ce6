"""Test helpers: a training folder in the trainer's format (docs/formats.md), made without the trainer.

`make_train_dir` writes draft_config.json, vocab.safetensors, model.safetensors (export names) and
a stage-"train" manifest. `fit_step0` is a short stand-in for `nestling.train` (switch to it once it
is merged): a few hundred Adam steps on step-0 next-token prediction from the real target's hidden
states, teacher = the target's greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from nestling.draft.model import DraftConfig, Eagle3Draft, KVCache
from nestling.draft.vocab import build_vocab, count_tokens, save_vocab, target_to_draft_index
from nestling.manifest import write_manifest
from nestling.targets.load import load_model, load_tokenizer, target_fingerprint

PROMPTS = [
    "List the days of the week, one per line.",
    "Count from one to twenty in words, separated by commas.",
    "Write the English alphabet in order, separated by spaces.",
    "Name the months of the year in order.",
    "Write a short poem about the sea.",
    "Explain what a CPU does in two sentences.",
]


def render(target: Path, prompts: list[str]) -> list[list[int]]:
    tok = load_tokenizer(target)
    return [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for p in prompts
    ]


def write_prompts_jsonl(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in prompts))
    return path


def new_draft(
    target: Path,
    aux_ids: list[int] | None = None,
    draft_vocab_size: int = 1024,
    vocab_tokens: torch.Tensor | None = None,
    seed: int = 0,
    layers: int = 1,
    norms: dict[str, bool] | None = None,
) -> Eagle3Draft:
    """A randomly initialised draft of `layers` decoder layers for `target`, with a vocab from tokens;
    `norms`: the draft norm options (DraftConfig fields, e.g. {"fc_norm": True})."""
    from transformers import AutoConfig

    from nestling.targets.layers import default_aux_layers, num_layers

    hf = AutoConfig.from_pretrained(target)
    aux_ids = aux_ids or default_aux_layers(num_layers(hf))
    cfg = DraftConfig.from_target(
        hf,
        min(draft_vocab_size, hf.vocab_size),
        aux_ids,
        target=str(target),
        target_fingerprint=target_fingerprint(target),
        num_hidden_layers=layers,
        **(norms or {}),
    )
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    counts = count_tokens([vocab_tokens if vocab_tokens is not None else torch.arange(cfg.vocab_size)], cfg.vocab_size)
    d2t, t2d = build_vocab(counts, cfg.draft_vocab_size)  # most frequent first, ties by lower id
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    return draft


def make_train_dir(draft: Eagle3Draft, out: Path) -> Path:
    """Write `draft` as a finished training folder (the trainer's output format)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    c = draft.config
    c.save(out / "draft_config.json")
    save_vocab(out / "vocab.safetensors", draft.d2t, draft.t2d)
    save_file({k: v.contiguous() for k, v in draft.export_state_dict().items()}, str(out / "model.safetensors"))
    write_manifest(
        out, "train", {"helper": "tests/eagle_helpers.py"}, inputs={"target": c.target_fingerprint}, target=c.target
    )
    return out


@torch.no_grad()
def greedy_sequences(target: Path, prompt_ids: list[list[int]], new_tokens: int) -> tuple[list[torch.Tensor], object]:
    model = load_model(target, dtype="float32")
    seqs = []
    for p in prompt_ids:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
        seqs.append(out[0])
    return seqs, model


def fit_step0(
    target: Path,
    prompt_ids: list[list[int]],
    aux_ids: list[int] | None = None,
    steps: int = 300,
    new_tokens: int = 64,
    draft_vocab_size: int = 1024,
    lr: float = 2e-3,
    seed: int = 0,
    layers: int = 1,
    norms: dict[str, bool] | None = None,
) -> Eagle3Draft:
    """Fit a draft on step-0 prediction: input (tok[t+1], combine(aux[t])) at position t -> target argmax
    at t+1."""
    import time

    t0 = time.perf_counter()
    seqs, model = greedy_sequences(target, prompt_ids, new_tokens)
    print(f"[fit] teacher sequences {time.perf_counter() - t0:.1f}s", flush=True)
    with torch.no_grad():
        feats, teach = [], []
        for s in seqs:
            o = model(s[None], output_hidden_states=True)
            feats.append(o.hidden_states)
            teach.append(o.logits[0].argmax(-1))  # teacher: target greedy next token at every position
    draft = new_draft(target, aux_ids, draft_vocab_size, torch.cat(teach), seed=seed, layers=layers, norms=norms)
    draft.embed_tokens.weight.data.copy_(model.get_input_embeddings().weight.data.float())
    ids = draft.config.aux_layer_ids
    t2d_idx = target_to_draft_index(draft.t2d)
    batch = []
    for s, hs, te in zip(seqs, feats, teach):
        aux = torch.cat([hs[i][0] for i in ids], -1)  # [T, n*H]
        T = s.numel()
        # index t: token s[t+1], aux[t], position t; label = target argmax after s[t+1] = te[t+1]
        lab = t2d_idx[te[1:]]
        batch.append((s[1:][None], aux[:-1][None], torch.arange(T - 1)[None], lab))
    params = [p for n, p in draft.named_parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    for it in range(steps):
        if it % 50 == 0:
            print(f"[fit] step {it} {time.perf_counter() - t0:.1f}s", flush=True)
        opt.zero_grad()
        loss = 0.0
        for tok, aux, pos, lab in batch:
            h = draft.step(tok, draft.combine(aux), pos, KVCache())
            lg = draft.logits(h)[0]
            keep = lab >= 0
            loss = loss + F.cross_entropy(lg[keep], lab[keep])
        (loss / len(batch)).backward()
        opt.step()
    return draft.eval()
