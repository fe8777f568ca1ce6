"""The reference speculative decoder: its output is the target's own output (greedy: token-identical
in fp32; sampling: the same distribution), and it refuses a draft from another target."""

from __future__ import annotations

import pytest
from capture_fixture import one_thread  # noqa: F401 (autouse: one thread for tiny shapes)
import torch

from eagle_helpers import make_train_dir, new_draft
from nestling.errors import NestlingError
from nestling.evaluate.specdec import SpecDecoder, load_draft, target_generate, verify_sampled
from nestling.export.run import export
from nestling.export.settings import ExportSettings
from nestling.targets.load import load_model

AUX = [1, 3, 4]


@pytest.fixture(scope="module")
def tiny(tiny_target):
    return tiny_target("llama")


@pytest.fixture(scope="module")
def model(tiny):
    return load_model(tiny, dtype="float32")


def _top_tokens(model, prompt, n):
    with torch.no_grad():
        lg = model(torch.tensor([prompt])).logits[0]
    return lg.topk(8, dim=-1).indices.flatten().unique()[:n]


@pytest.fixture(scope="module")
def draft_dir(tiny, model, tmp_path_factory):
    """A draft whose vocab holds the target's likely tokens and whose head is flat (lm_head = 0):
    q is uniform over the draft vocab, so drafts are sometimes accepted and sometimes rejected."""
    prompt = list(range(100, 120))
    draft = new_draft(tiny, AUX, draft_vocab_size=64, vocab_tokens=_top_tokens(model, prompt, 64))
    with torch.no_grad():
        draft.lm_head.weight.zero_()
    root = tmp_path_factory.mktemp("spec")
    return export(make_train_dir(draft, root / "train"), root / "draft", ExportSettings(dtype="float32"))


def test_greedy_equals_target(model, draft_dir):
    torch.manual_seed(0)
    draft = load_draft(draft_dir, model)
    with torch.no_grad():  # a random head, so drafts are mostly rejected: both paths run
        draft.lm_head.weight.normal_(0, 0.5)
    for k, p in ((1, [5, 6, 7, 8]), (3, list(range(200, 230)))):
        dec = SpecDecoder(model, draft, k=k)
        out, st = dec.generate(p, 16)
        ref, _ = target_generate(model, p, 16)
        assert out == ref
        assert st.new_tokens == 16 and st.num_draft_tokens <= k * st.num_drafts


def test_greedy_with_perfect_draft_accepts_everything(model, tiny, tmp_path):
    """A draft that 'predicts' by running the target (a cheat) must be accepted at every position:
    checks the bookkeeping of positions and caches against acceptance, not only output equality."""
    draft = load_draft(
        export(
            make_train_dir(new_draft(tiny, AUX, 64), tmp_path / "t"), tmp_path / "d", ExportSettings(dtype="float32")
        ),
        model,
    )
    dec = SpecDecoder(model, draft, k=3)
    prompt = [5, 6, 7, 8]
    ref, _ = target_generate(model, prompt, 24 + 3)  # the last draft reaches past the budget (as vLLM's)

    # the chain is replaced by the true continuation: draft id j -> the token at absolute index j
    full = prompt + ref
    dec.draft_targets = torch.tensor(full + [0] * 8)  # draft id j -> target token at absolute index j
    positions = []
    orig_step = draft.step

    def step(ids, hidden, pos, cache):
        positions.append(int(pos[0, -1]))
        return orig_step(ids, hidden, pos, cache)

    draft.step = step

    def fake_logits(h):
        nxt = positions[-1] + 2  # the draft at position t predicts the token at t + 2
        out = torch.full((1, 1, len(dec.draft_targets)), -1e9)
        out[0, 0, nxt] = 0
        return out

    draft.logits = fake_logits
    out, st = dec.generate(prompt, 24)
    assert out == ref[:24]
    assert st.num_accepted_tokens == st.num_draft_tokens == 3 * st.num_drafts  # every draft accepted, K each
    assert st.acceptance_length == 1 + 3


def test_rejection_sampling_is_exact():
    """Output distribution of one verification step equals p, for a q that differs from p."""
    g = torch.Generator().manual_seed(0)
    V = 6
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    q = torch.tensor([0.1, 0.5, 0.0, 0.3, 0.1, 0.0])  # zero off its vocab, like a draft vocab
    counts = torch.zeros(V)
    n = 20000
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=g))
        m, y = verify_sampled(torch.stack([p, p]), q[None], [d], g)
        counts[d if m == 1 else y] += 1
    tv = 0.5 * (counts / n - p).abs().sum()
    assert tv < 0.015  # ~4 sigma for n=20000 over 6 outcomes


@torch.no_grad()
def _target_sequence_probs(
    model, prompt: list[int], n_new: int, temperature: float, floor: float
) -> dict[tuple[int, ...], float]:
    """The exact probability of every `n_new`-token continuation the target alone samples at
    `temperature` with probability >= `floor` (a prefix is at least as likely as its continuations,
    so pruning prefixes below `floor` loses none of them)."""
    seqs = {(): 1.0}
    for _ in range(n_new):
        keys = list(seqs)
        batch = torch.tensor([prompt + list(k) for k in keys])  # equal lengths: one batched forward
        probs = torch.softmax(model(batch, logits_to_keep=1).logits[:, -1].float() / temperature, dim=-1)
        seqs = {
            k + (t,): seqs[k] * float(pr[t])
            for k, pr in zip(keys, probs)
            for t in (pr * seqs[k] >= floor).nonzero().flatten().tolist()
        }
    return seqs


def _chi2_critical(dof: int, z: float = 3.0902) -> float:
    """Upper critical value of chi-square at p = 0.001 (z of the normal), Wilson-Hilferty (within
    ~1% of the exact value for dof >= 2; no scipy here)."""
    a = 2.0 / (9 * dof)
    return dof * (1 - a + z * a**0.5) ** 3


def test_sampling_matches_target_distribution(model, draft_dir):
    """Goodness of fit of the first 3 sampled tokens, jointly: spec decoding against the target's
    exact distribution of 3-token continuations (computed, not sampled), chi-square at p = 0.001.
    K = 2 and 3 new tokens: the 2nd and 3rd tokens go through acceptance and residual sampling, and
    where the first draft is rejected, through a second draft round. This holds the decoder's wiring
    (which target rows, which q, the continuation) to the target's distribution; the acceptance rule
    itself is held exact by test_rejection_sampling_is_exact, with a q far from p. (It sampled the
    target too and compared marginals, 200 + 200 runs: 4-7 minutes under load; now 7-10 s.)"""
    from capture_fixture import threads

    draft = load_draft(draft_dir, model)
    T = 0.05  # peaked: the 5 likeliest continuations hold 0.71 of the mass, so n = 100 gives cells of >= 5
    prompt = list(range(100, 120))
    n = 100
    exact = _target_sequence_probs(model, prompt, 3, T, floor=1 / n)  # every cell expecting >= 1 sample
    # probabilistic: this random draft's argmax is rarely the target's token, so greedy drafts would
    # leave the acceptance path unexercised (tests/test_eval_sampling.py holds both methods exact)
    dec = SpecDecoder(model, draft, k=2, temperature=T, draft_sample_method="probabilistic")
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    with threads(1):  # tiny shapes on a shared 2-core machine
        for s in range(n):
            o, st = dec.generate(prompt, 3, seed=s)
            counts[tuple(o)] = counts.get(tuple(o), 0) + 1
            accepted += st.num_accepted_tokens
    assert accepted > 5  # the acceptance path ran, not only the residual path
    big = [k for k, pr in exact.items() if n * pr >= 5]  # cells with expected counts >= 5; the rest pooled
    obs = [counts.get(k, 0) for k in big]
    exp = [n * exact[k] for k in big]
    obs.append(n - sum(obs))
    exp.append(n - sum(exp))
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    dof = len(big) if exp[-1] > 0 else len(big) - 1
    assert dof >= 2, exp  # the test has cells to compare
    assert chi2 < _chi2_critical(dof), (chi2, dof, list(zip(obs, exp)))


def test_eval_refuses_draft_of_another_target(tiny_target, draft_dir, tmp_path):
    from nestling.evaluate.run import evaluate
    from nestling.evaluate.settings import EvalSettings

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    with pytest.raises(NestlingError, match="another target|its own target"):
        evaluate(
            draft_dir,
            tiny_target("llama", seed=1),
            prompts,
            tmp_path / "e",
            EvalSettings(max_new_tokens=4, engine="reference"),
        )


def test_eval_reference_report(tiny, draft_dir, tmp_path, capsys):
    from nestling.evaluate.run import evaluate
    from nestling.evaluate.settings import EvalSettings

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "Say hello."}]}\n{"prompt": "Count to five."}\n')
    rep = evaluate(draft_dir, tiny, prompts, tmp_path / "e", EvalSettings(max_new_tokens=12, k=2, engine="reference"))
    err = capsys.readouterr().err  # device and dtype auto: each choice in one log line
    assert "[eval] device auto: cpu (torch sees no GPU)" in err and "[eval] dtype auto: float32" in err
    r = rep["engines"]["reference"]
    assert (r["device"], r["dtype"]) == ("cpu", "float32")
    assert r["identical_share"] == 1.0  # greedy fp32: same as the target alone
    assert r["acceptance_length"] == pytest.approx(1 + r["num_accepted_tokens"] / r["num_drafts"])
    assert len(r["per_position"]) == 2
    # the share of generated tokens the draft could ever propose (its 64-token vocabulary)
    from safetensors.torch import load_file

    t2d = load_file(str(draft_dir / "model.safetensors"))["t2d"]
    tokens = [t for o in r["outputs"] for t in o]
    inside = sum(bool(t2d[t]) for t in tokens) / len(tokens)
    assert r["draftable_share"] == inside and r["num_accepted_tokens"] <= inside * len(tokens)
    md = (tmp_path / "e" / "report.md").read_text()
    assert f"| {100 * inside:.1f}% |" in md
    # each prompt's forwards, in prompt order (1 to k + 1 tokens each), and the standard error from them
    from nestling.evaluate.standard_error import plus_minus, ratio_standard_error

    assert len(r["forwards"]) == 2 and sum(r["forwards"]) == r["target_forwards"]
    assert all(n <= len(o) <= 3 * n for o, n in zip(r["outputs"], r["forwards"]))
    se = ratio_standard_error([len(o) for o in r["outputs"]], r["forwards"])
    assert se is not None and r["tokens_per_forward_se"] == se
    assert f"| {plus_minus(r['mean_tokens_per_target_forward'], se)} |" in md and " ± " in md
    assert "reference: greedy output identical to the target alone on 2 of 2 prompts (100%)." in md
    for f in ("report.json", "report.md", "acceptance.png", "manifest.json"):
        assert (tmp_path / "e" / f).exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 1}\n')
    with pytest.raises(NestlingError, match="bad.jsonl:1"):
        evaluate(draft_dir, tiny, bad, tmp_path / "e2", EvalSettings(max_new_tokens=4, engine="reference"))


def test_batch_reports_its_spent_budget_while_it_decodes(model, draft_dir, tiny, tmp_path, capsys):
    """A batch holding every prompt is one call: it reports the token budget spent so far (a finished
    prompt counts its whole share) while it decodes, so eval shows a rate and an ETA, not minutes of
    silence; the reports only grow, stay within the budget, and do not change the output."""
    draft = load_draft(draft_dir, model)
    dec = SpecDecoder(model, draft, k=2)
    prompts = [[5, 6, 7, 8], list(range(200, 230)), [9, 10]]
    seen: list[int] = []
    out, _, _ = dec.generate_batch(prompts, 12, on_progress=seen.append, progress_every_s=0.0)
    assert seen and seen == sorted(seen) and 0 < seen[-1] <= 3 * 12
    assert out == dec.generate_batch(prompts, 12)[0]
    from nestling.evaluate.run import evaluate
    from nestling.evaluate.settings import EvalSettings

    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text('{"prompt": "Say hello."}\n{"prompt": "Count to five."}\n')
    evaluate(draft_dir, tiny, prompts_file, tmp_path / "e", EvalSettings(max_new_tokens=12, k=2, engine="reference"))
    assert "[eval reference] 24/24 tokens (100.0%)" in capsys.readouterr().err


def test_report_says_what_a_low_identical_share_means():
    """Below 100%, the report says it is the engine's rounding with the forward's shape, not the draft."""
    from nestling.evaluate.report import identical_note, markdown

    r = {"identical_share": 0.25, "baseline_outputs": [[1]] * 4, "acceptance_length": 2.0, "per_position": [0.5]}
    r.update(tokens_per_s=1.0)
    note = identical_note("vllm", r)
    assert note.startswith("vllm: greedy output identical to the target alone on 1 of 4 prompts (25%).")
    assert "cannot change a greedy output" in note and "K+1 tokens" in note and "nothing about the draft" in note
    rep = {"draft": "d", "target": "t", "k": 1, "num_prompts": 4, "max_new_tokens": 8, "temperature": 0.0}
    assert note in markdown({**rep, "engines": {"vllm": r}})


def test_draftable_share_counts_the_draft_vocabulary(tiny, tmp_path):
    """A folder with t2d: the share of tokens it marks; a whole-vocabulary draft (no t2d): every token."""
    from nestling.evaluate.run import draftable_share

    small = new_draft(tiny, AUX, draft_vocab_size=64, vocab_tokens=torch.arange(10, 74))
    d = export(make_train_dir(small, tmp_path / "t"), tmp_path / "d", ExportSettings(dtype="float32"))
    assert draftable_share(d, [[10, 11, 5], [73, 74]]) == 3 / 5
    full = new_draft(tiny, AUX, draft_vocab_size=49152)
    f = export(make_train_dir(full, tmp_path / "tf"), tmp_path / "f", ExportSettings(dtype="float32"))
    assert draftable_share(f, [[10, 11, 5], [73, 74]]) == 1.0


def test_draft_sample_method_reaches_the_decoder_the_report_and_vllm(tiny, draft_dir, tmp_path, capsys):
    """`--draft-sample-method` (vLLM's speculative_config.draft_sample_method): greedy by default, as in
    vLLM; the CLI's choice reaches the reference decoder's report (head and settings) and the vLLM
    worker's speculative_config, which names the option only where it is not vLLM's default (an engine
    that predates it still loads); an unknown value is refused with what to give."""
    import json

    from nestling.cli import main
    from nestling.evaluate.settings import EvalSettings
    from nestling.evaluate.vllm_worker import speculative_config

    assert EvalSettings().draft_sample_method == "greedy"
    with pytest.raises(NestlingError, match="greedy .vLLM's default. or probabilistic"):
        EvalSettings(draft_sample_method="sampled")  # type: ignore[arg-type]
    spec = {"k": 3}
    assert speculative_config(spec, "d") == {"method": "eagle3", "model": "d", "num_speculative_tokens": 3}
    spec["draft_sample_method"] = "probabilistic"
    assert speculative_config(spec, "d")["draft_sample_method"] == "probabilistic"

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Count to five."}\n')
    args = ["eval", str(draft_dir), "--target", str(tiny), "--prompts", str(prompts), "--engine", "reference"]
    args += ["--k", "2", "--max-new-tokens", "6", "--temperature", "0.5", "baseline=false"]
    for method in ("greedy", "probabilistic"):
        out = tmp_path / method
        assert main([*args, "--out", str(out), "--draft-sample-method", method]) == 0
        report = json.loads((out / "report.json").read_text())
        assert report["settings"]["draft_sample_method"] == method
        assert f"temperature 0.5 (draft_sample_method {method})" in (out / "report.md").read_text()
        assert f"temperature=0.5 (draft_sample_method {method})" in capsys.readouterr().err
