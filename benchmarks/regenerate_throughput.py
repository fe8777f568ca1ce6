"""Regeneration throughput per engine: conversations/s and output tokens/s on SmolLM2 + ShareGPT.

    PYTHONPATH=src python benchmarks/regenerate_throughput.py --engines vllm,openai,hf --n 32 --max-new-tokens 128

Regenerates the first assistant turn of the first N usable ShareGPT conversations with each engine
(the openai engine against vLLM's own server started here on loopback) and prints a table; the
rates exclude model loading (they come from the stage manifest's generation time), the load
column is the rest of the wall time. JSON goes to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def _sample(n: int, path: Path, source: Path | None) -> Path:
    from nestling.assets import sharegpt_json
    from nestling.regenerate.chat import plan
    from nestling.regenerate.readers import read_records

    rows = []
    for rec in read_records(source or sharegpt_json()):
        if not rec.skip and plan(rec.messages, 1)[0]:
            rows.append({"id": rec.id, "messages": rec.messages})
            if len(rows) == n:
                break
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _server(target: Path, args, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(target),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(args.max_model_len),
        "--dtype",
        args.dtype,
    ] + (["--enforce-eager"] if args.enforce_eager else [])
    p = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    while True:
        if p.poll() is not None:
            raise SystemExit(f"server died:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=5).read()
            return p, url
        except OSError:
            time.sleep(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="vllm,openai,hf")
    ap.add_argument("--n", type=int, default=32, help="conversations")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--target", help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--sharegpt", type=Path, help="ShareGPT JSON (default: the embedded one from the package index)")
    ap.add_argument(
        "--hf-batch-size", type=int, default=0, help="hf engine: requests per batch (0 = auto: 8 on CPU, 1024 on CUDA)"
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda (hf engine device; vLLM picks its platform)")
    ap.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument(
        "--enforce-eager",
        action="store_true",
        help="vLLM without torch.compile / CUDA graphs (much faster start on a loaded CPU; slower steps)",
    )
    ap.add_argument("--json", type=Path, default=Path("regenerate_throughput.json"))
    args = ap.parse_args()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    from nestling.assets import smollm2_dir
    from nestling.regenerate.run import regenerate
    from nestling.regenerate.settings import RegenerateSettings

    target = Path(args.target) if args.target else smollm2_dir()
    work = Path(tempfile.mkdtemp(prefix="regen-bench-"))
    data = _sample(args.n, work / "in.jsonl", args.sharegpt)
    rows = []
    for engine in args.engines.split(","):
        s = RegenerateSettings(
            engine=engine,
            max_new_tokens=args.max_new_tokens,
            max_turns=1,
            chunk_size=args.n,
            max_model_len=args.max_model_len,
            dtype=args.dtype,
            device=args.device,
            hf_batch_size=args.hf_batch_size,
            concurrency=args.n,
            vllm={"enforce_eager": True} if args.enforce_eager else {},
        )
        server = None
        t0 = time.monotonic()
        if engine == "openai":
            server, url = _server(target, args, work / "server.log")
            s.urls = [url]
        t1 = time.monotonic()
        try:
            m = regenerate(data, target, work / engine, s)
        finally:
            if server is not None:
                os.killpg(server.pid, signal.SIGTERM)
                server.wait()
        wall = time.monotonic() - t1
        g = m["generation"]
        rows.append(
            {
                "engine": engine,
                "conversations": m["counts"]["kept"],
                "output_tokens": g["output_tokens"],
                "gen_s": g["seconds"],
                "conv_per_s": g["conversations_per_s"],
                "out_tok_per_s": g["output_tokens_per_s"],
                "load_s": round(wall - g["seconds"] + (t1 - t0), 1),
            }
        )
    print(
        f"\nregenerate throughput: {args.n} ShareGPT conversations, first turn, max_new_tokens {args.max_new_tokens}, "
        f"{args.dtype}, device {args.device}"
    )
    print(f"{'engine':8} {'conv':>5} {'out tok':>8} {'gen s':>8} {'conv/s':>8} {'out tok/s':>10} {'load s':>7}")
    for r in rows:
        print(
            f"{r['engine']:8} {r['conversations']:5d} {r['output_tokens']:8d} {r['gen_s']:8.1f} {r['conv_per_s']:8.3f} "
            f"{r['out_tok_per_s']:10.1f} {r['load_s']:7.1f}"
        )
    args.json.write_text(
        json.dumps(
            {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "results": rows},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
