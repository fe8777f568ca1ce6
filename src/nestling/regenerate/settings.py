"""Settings of the regenerate stage (one dataclass; YAML + `key=value` overrides via nestling.config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Engine = Literal["auto", "vllm", "openai", "hf"]
Reasoning = Literal["keep", "strip", "disable"]


@dataclass
class RegenerateSettings:
    """How the target rewrites every assistant turn of the input conversations.

    Only the fields in `OUTPUT_FIELDS` change what is written; the others (where and how fast
    we generate) may change between a run and its resumption.
    """

    engine: Engine = "auto"  # auto: openai when urls are given, else vllm when installed, else hf
    # chat: answer every assistant turn; text: continue a prefix of each text record (base models,
    # text.py); auto: text when the target's tokenizer has no chat template, else chat
    mode: Literal["auto", "chat", "text"] = "auto"
    # text mode: the first prefix_tokens tokens of each record (special tokens such as BOS included) are
    # kept and the target writes on from there; prefix_fraction > 0 takes that share of its tokens instead
    prefix_tokens: int = 64
    prefix_fraction: float = 0.0
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 1024  # per assistant turn
    seed: int = 0  # per-request seeds derive from it (sampling only)
    n: int = (
        1  # answers per conversation: n > 1 writes n rows per input conversation, each sampled (needs temperature > 0)
    )
    # besides those answers, this many more per conversation sampled at sampled_temperature (seeded
    # apart from the main pass), written to OUT/sampled/ (SAMPLED); `nestling run`'s data stage reads
    # both. Greedy plus one sampled answer per turn measured +0.18-0.23 tokens per target forward over
    # ShareGPT's own answers (+0.22 over greedy alone) in vLLM at equal conversations, +0.07-0.09 over
    # greedy alone on all of ShareGPT at 45M training tokens; examples/gpu.yaml sets it
    # (docs/regenerate.md): twice the target-written text from the same prompts, at twice the regeneration time
    sampled: int = 0
    sampled_temperature: float = 0.7
    reasoning: Reasoning = "keep"  # keep / strip <think>..</think> from answers / disable thinking in the template
    max_model_len: int = 0  # prompt + answer limit; 0 = the target's max_position_embeddings
    max_turns: int = 0  # regenerate (and keep) only the first N assistant turns; 0 = all
    limit: int = 0  # only the first N input records; 0 = all
    # "I/N": only the records whose index in the file (after `limit`) is I modulo N, for N processes
    # side by side, one per GPU, each with its own --out (the hf engine runs on one GPU); the data stage
    # then reads every shard's messages.jsonl (docs/regenerate.md, "Several GPUs"). "" = all
    shard: str = ""
    # conversations per engine call, committed together (the unit of resumption); 0 = auto (engine.py)
    chunk_size: int = 0
    save_token_ids: bool = False  # also write the generated token ids of every turn (for checks)
    # finished conversations of the chunk in flight go to partial.jsonl at most this often (seconds), so
    # a crash inside a large chunk loses only what was running and this much finished work (journal.py)
    journal_every_s: float = 10.0
    dtype: str = "auto"  # vllm / hf weights dtype: auto, bfloat16, float16, float32
    # engine: hf
    device: str = "auto"  # auto: cuda when torch sees a GPU, else cpu
    hf_fast: bool = True  # the static-cache decode loop (CUDA graphs on a GPU); false = transformers generate
    hf_batch_size: int = 0  # slots (fast) / requests per batch (generate); 0 = auto: 8 on CPU, 1024 on CUDA
    hf_batch_tokens: int = 0  # KV-cache tokens, slots x length (fast) / padded tokens per batch (generate); 0 = auto: 262144 on CPU, from free GPU memory on CUDA
    # fast loop attention: auto = flash on a GPU that runs it (each slot reads only its own keys;
    # checked against matmul on the first step), else matmul (float32 scores); sdpa: torch's fused kernel
    hf_attention: Literal["auto", "matmul", "sdpa", "flash"] = "auto"
    hf_stream: bool = False  # fast loop: a conversation's next turn joins the running slots (else turn by turn)
    # engine: openai (one or several OpenAI-compatible servers, requests spread round-robin)
    urls: list[str] = field(default_factory=list)
    server_model: str = ""  # model name on the server; "" = the first one /v1/models lists
    api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the key (never stored)
    concurrency: int = 16  # requests in flight per server
    retries: int = 5
    timeout_s: float = 600.0
    # engine: vllm (extra keyword arguments for vllm.LLM, e.g. tensor_parallel_size, enforce_eager)
    vllm: dict[str, Any] = field(default_factory=dict)


SAMPLED = "sampled"  # the subfolder of OUT that the `sampled` pass writes (a regenerate folder of its own)

# Settings that determine the output; a rerun with different values must not resume a folder.
OUTPUT_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "max_new_tokens",
    "seed",
    "n",
    "reasoning",
    "max_model_len",
    "max_turns",
    "limit",
    "shard",
    "chunk_size",
    "save_token_ids",
)
# output fields added later, with the value that means "as before": left out of the fingerprint at that
# value, so a folder written before they existed still resumes and still counts as finished
ADDED_LATER = {"shard": ""}
# output fields of the text mode, fingerprinted (mode resolved) only there: chat-mode folders keep theirs
TEXT_FIELDS = ("mode", "prefix_tokens", "prefix_fraction")


def output_settings(s: RegenerateSettings) -> dict:
    """The settings a regeneration's output depends on (what its fingerprint hashes)."""
    out = {k: getattr(s, k) for k in OUTPUT_FIELDS + (TEXT_FIELDS if s.mode == "text" else ())}
    return {k: v for k, v in out.items() if not (k in ADDED_LATER and v == ADDED_LATER[k])}
