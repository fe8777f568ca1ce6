"""`nestling regenerate INPUT --target MODEL --out DIR`: thin CLI over `run.regenerate`."""

from __future__ import annotations

import argparse
from pathlib import Path

from nestling.config import settings_from_args
from nestling.regenerate.settings import SAMPLED, RegenerateSettings

HELP = """\
Regenerate every assistant turn of a chat dataset with the target itself, in order, each turn
conditioned on the history regenerated so far and rendered with the target's own chat template.
Drafts trained on the target's own answers accept more tokens.

Input: ShareGPT JSON/JSONL ({"conversations": [{"from", "value"}]}) or messages JSONL
({"messages": [{"role", "content"}]}). Output: DIR/messages.jsonl (read by `nestling data` as is),
DIR/failed.jsonl (every failed or skipped record with its reason) and DIR/manifest.json (counts:
kept + failed + skipped = read). Interrupted runs continue where they stopped when rerun.

sampled=M adds M sampled answers per conversation (at sampled_temperature, 0.7) in DIR/sampled/,
besides the greedy ones: twice the target-written text from the same prompts, which measured
+0.18-0.23 tokens per target forward over ShareGPT's own answers on SmolLM2, +0.22 over the greedy
answers alone at 2,000 conversations, +0.07-0.09 on all of ShareGPT at 45M training tokens
(examples/gpu.yaml sets it; docs/regenerate.md). Train on both:
  nestling data DIR/messages.jsonl DIR/sampled/messages.jsonl --target MODEL --out DATA
(`nestling run` does this by itself when its regenerate: section says sampled: 1).

A target without a chat template (a base model) continues text instead (mode=text, the default
there): each record's `text` (or a chat record's messages, joined) is cut to its first prefix_tokens
tokens (64; or prefix_fraction of them) and the target writes on; DIR/text.jsonl holds {"text": ...}
records for `nestling data` (docs/regenerate.md, "Base models").

Any setting can also come from --config FILE (YAML) or a trailing key=value, e.g.
  nestling regenerate sharegpt.json --target ./SmolLM2 --out regen max_turns=1 vllm.enforce_eager=true
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "regenerate",
        help="rewrite the assistant turns of chat data with the target",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("input", type=Path, help="chat data: ShareGPT .json/.jsonl or messages .jsonl")
    p.add_argument("--target", required=True, help="the target model: a local Hugging Face folder or a .gguf file")
    p.add_argument("--out", required=True, type=Path, help="output folder (resumed when it holds an unfinished run)")
    p.add_argument(
        "--engine",
        choices=["auto", "vllm", "openai", "hf"],
        help="vllm: in-process vLLM (default when installed); openai: OpenAI-compatible server(s) "
        "given by --url; hf: transformers generate (the fallback)",
    )
    p.add_argument(
        "--url",
        action="append",
        dest="urls",
        metavar="URL",
        help="OpenAI-compatible server base URL, e.g. http://127.0.0.1:8000; repeat for data-parallel servers",
    )
    p.add_argument("--temperature", type=float, help="sampling temperature (default 0 = greedy)")
    p.add_argument("--top-p", type=float, help="nucleus sampling (default 1.0 = off)")
    p.add_argument("--top-k", type=int, help="top-k sampling (default 0 = off)")
    p.add_argument(
        "--n",
        type=int,
        help="answers per conversation (default 1); n > 1 writes n sampled rows per "
        "conversation (needs --temperature > 0), seeded so a rerun repeats them",
    )
    p.add_argument("--max-new-tokens", type=int, help="longest answer per assistant turn (default 1024)")
    p.add_argument(
        "--max-model-len",
        type=int,
        help="prompt + answer limit in tokens; longer prompts fail as context_overflow "
        "(default: the target's max_position_embeddings)",
    )
    p.add_argument(
        "--reasoning",
        choices=["keep", "strip", "disable"],
        help="templates with thinking: keep the <think> block, strip it from the stored answer, "
        "or disable thinking in the template (enable_thinking=False). Default keep",
    )
    p.add_argument("--max-turns", type=int, help="regenerate only the first N assistant turns (default 0 = all)")
    p.add_argument("--limit", type=int, help="only the first N input records (default 0 = all)")
    p.add_argument(
        "--shard",
        metavar="I/N",
        help="only the records whose index is I modulo N: one process per GPU, each with its own --out "
        "(docs/regenerate.md, 'Several GPUs'; default all)",
    )
    p.add_argument("--dtype", help="weights dtype for vllm/hf: auto, bfloat16, float16, float32 (default auto)")
    p.add_argument(
        "--device",
        help="device for --engine hf: auto (default: cuda when torch sees a GPU, else cpu), cpu, cuda, cuda:N",
    )
    p.add_argument("--config", type=Path, help="YAML file with settings (RegenerateSettings fields)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="setting overrides, e.g. chunk_size=128")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from nestling.regenerate.run import regenerate

    flags: tuple[str, ...] = ("engine", "urls", "temperature", "n", "top_p", "top_k", "max_new_tokens", "max_model_len")
    flags += ("reasoning", "max_turns", "limit", "shard", "dtype", "device")
    s = settings_from_args(RegenerateSettings, args, flags)
    manifest = regenerate(args.input, args.target, args.out, s)
    c = manifest["counts"]
    print(
        f"{args.out / manifest['files']['messages']}: {c['kept']} kept, {sum(c['failed'].values())} failed, "
        f"{sum(c['skipped'].values())} skipped of {c['read']}"
    )
    if "sampled" in manifest:
        c = manifest["sampled"]["counts"]
        print(f"{args.out / SAMPLED / manifest['sampled']['files']['messages']}: {c['kept']} kept (sampled pass)")
    return 0
