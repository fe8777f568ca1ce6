"""Base-model targets for the text-mode tests: the tiny random-weight Llama with its chat template taken
away. Its tokenizer (SmolLM2's) adds no special token to a text and ends a document with EOS
(`<|im_end|>`); `with_bos=True` also makes it start every text with BOS (`<|im_start|>`), as Llama's
and Gemma's tokenizers do."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


def without_chat_template(src: Path, out: Path, with_bos: bool = False) -> Path:
    """A copy of the model folder `src` in `out` whose tokenizer has no chat template (built once)."""
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.name == "chat_template.jinja" or not f.is_file():
            continue
        if f.name == "tokenizer_config.json":
            cfg = json.loads(f.read_text())
            cfg.pop("chat_template", None)
            (tmp / f.name).write_text(json.dumps(cfg, indent=2))
        elif f.name == "tokenizer.json" and with_bos:
            tok = json.loads(f.read_text())
            bos = next(t for t in tok["added_tokens"] if t["content"] == "<|im_start|>")
            tok["post_processor"] = {
                "type": "TemplateProcessing",
                "single": [
                    {"SpecialToken": {"id": bos["content"], "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}},
                ],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {
                    bos["content"]: {"id": bos["content"], "ids": [bos["id"]], "tokens": [bos["content"]]}
                },
            }
            (tmp / f.name).write_text(json.dumps(tok))
        else:
            shutil.copyfile(f, tmp / f.name)
    try:
        tmp.rename(out)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out
