"""Where the draft's input states come from: the capture store (offline) or the target itself (online).

Offline, `nestling capture` wrote the aux and final states to disk and the trainer reads them back.
Online, the trainer reads only the data stage's token ids, packs them exactly as offline (the same
`Stream` and `collate`), and right before each draft step runs the target on the training device with
the capture stage's own `HFBackend`: the same layer ids, the same dtype rule and the same post-norm
final state, so the draft sees the values the capture store would hold for those samples, and
nothing is stored. The target costs GPU memory and time per step instead of disk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from nestling.devices import resolve_device
from nestling.errors import NestlingError
from nestling.manifest import MANIFEST, hash_json, read_manifest
from nestling.train.ttt import PackedBatch

if TYPE_CHECKING:
    from nestling.train.inputs import Inputs
    from nestling.train.settings import TrainSettings


# ---- which mode a folder asks for ------------------------------------------------------------------


def folder_stage(path: Path) -> str | None:
    """The stage that wrote `path` ('data', 'capture', ...), None when it is no complete stage folder."""
    try:
        return json.loads((Path(path) / MANIFEST).read_text()).get("stage")
    except (OSError, ValueError):
        return None


def check_mode(source: Path, online: bool) -> None:
    """A data folder trains only online and a capture folder only offline; say which command fits."""
    stage = folder_stage(source)
    if not online and stage == "data":
        raise NestlingError(
            f"{source} is a data-stage folder (token ids, no hidden states). Train on it online, running the "
            f"target batch by batch: `nestling train {source} --online --target MODEL --out OUT`; or capture it "
            f"first (`nestling capture {source} --target MODEL --out CAPTURE`) and train on CAPTURE"
        )
    if online and stage == "capture":
        raise NestlingError(
            f"{source} is a capture folder: online training reads the data stage's folder instead "
            "(the capture manifest's data_dir); or drop --online to train on the stored states"
        )


def is_online(s: "TrainSettings") -> bool:
    return getattr(s, "online", False) is True


# ---- the data stage's tokens, held compactly --------------------------------------------------------


@dataclass
class TokenSplit:
    """One split of the data stage as flat tensors (int32 ids, bool mask, offsets): ~5 bytes a token,
    not the ~70 of Python lists, so 100M tokens fit in host memory."""

    sample_ids: list[str]
    ids: torch.Tensor  # int32 [N]
    mask: torch.Tensor  # bool [N]
    starts: torch.Tensor  # int64 [n + 1]

    def __len__(self) -> int:
        return len(self.sample_ids)

    def lengths(self) -> list[int]:
        return (self.starts[1:] - self.starts[:-1]).tolist()

    def __getitem__(self, i: int) -> dict:
        a, b = int(self.starts[i]), int(self.starts[i + 1])
        return {"sample_id": self.sample_ids[i], "input_ids": self.ids[a:b].long(), "loss_mask": self.mask[a:b]}


def read_split(data_dir: Path, split: str, vocab_size: int, max_pos: int | None) -> TokenSplit:
    """Read and check one split's parquet shards (the checks capture makes before its first forward)."""
    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from nestling.data.dataset import split_files

    sids: list[str] = []
    ids_l, mask_l, lens_l = [], [], []
    for f in split_files(data_dir, split):
        t = pq.read_table(f, columns=["input_ids", "loss_mask", "sample_id"])
        ids, mask = t.column("input_ids").combine_chunks(), t.column("loss_mask").combine_chunks()
        n_ids = np.asarray(pc.list_value_length(ids).fill_null(0))
        n_mask = np.asarray(pc.list_value_length(mask).fill_null(0))
        names = t.column("sample_id").to_pylist()
        bad = np.flatnonzero((n_ids == 0) | (n_ids != n_mask))
        if bad.size:
            raise NestlingError(
                f"{data_dir}: sample {names[bad[0]]} is empty or its loss_mask length differs from "
                "its input_ids; run `nestling data` again"
            )
        if max_pos and n_ids.max() > max_pos:
            k = int(n_ids.argmax())
            raise NestlingError(
                f"{data_dir}: sample {names[k]} has {n_ids[k]} tokens, more than the target's "
                f"max_position_embeddings {max_pos}; run `nestling data` with --max-length {max_pos}"
            )
        sids += names
        ids_l.append(torch.from_numpy(np.asarray(ids.flatten(), dtype=np.int32).copy()))
        mask_l.append(torch.from_numpy(np.asarray(mask.flatten(), dtype=np.int8).copy()).bool())
        lens_l.append(torch.from_numpy(n_ids.astype(np.int64)))
    ids = torch.cat(ids_l) if ids_l else torch.zeros(0, dtype=torch.int32)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise NestlingError(
            f"{data_dir}: the {split} split holds token ids outside the target's vocabulary "
            f"(size {vocab_size}): it was tokenized for another target"
        )
    lens = torch.cat(lens_l) if lens_l else torch.zeros(0, dtype=torch.long)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    return TokenSplit(sids, ids, torch.cat(mask_l) if mask_l else torch.zeros(0, dtype=torch.bool), starts)


# ---- inputs of an online run ----------------------------------------------------------------------


@dataclass
class OnlineData:
    """What an online run adds to the trainer's Inputs: the tokens and how to run the target."""

    data_dir: Path
    layer_ids: list[int]  # aux ids + the final state L
    splits: dict[str, TokenSplit]


def target_dtype(s: "TrainSettings", device: torch.device) -> str:
    """Capture's rule (bf16 on CUDA, fp32 on a CPU unless set), so online states equal a capture's."""
    from nestling.capture.settings import CaptureSettings, resolve

    return resolve(CaptureSettings(device=str(device), dtype=getattr(s, "target_dtype", "auto"))).dtype


def online_inputs(data_dir: Path, s: "TrainSettings") -> "Inputs":
    """Check a data-stage folder and the target before anything loads; the Inputs of an online run."""
    from nestling.capture.run import check_data_tokenizer
    from nestling.data.dataset import SPLITS, split_files
    from nestling.targets.layers import default_aux_layers, num_layers, validate_layer_ids
    from nestling.targets.load import (
        load_config,
        load_tokenizer,
        resolve_target,
        target_fingerprint,
        tokenizer_fingerprint,
    )
    from nestling.train.inputs import Inputs

    data_dir = Path(data_dir)
    if not data_dir.exists():
        raise NestlingError(
            f"data folder {data_dir} does not exist; create it with `nestling data INPUT --target MODEL --out {data_dir}`"
        )
    m = read_manifest(data_dir, "data")
    tgt = s.target or m.get("target")
    if not tgt:
        raise NestlingError("online training runs the target: pass --target MODEL (the data manifest names none)")
    target = resolve_target(tgt)
    if (m.get("inputs") or {}).get("tokenizer"):
        check_data_tokenizer(data_dir, m, tokenizer_fingerprint(load_tokenizer(target)))
    cfg = load_config(target)
    text = getattr(cfg, "text_config", None) or cfg
    L = num_layers(cfg)
    aux = [int(i) for i in s.aux_layer_ids] if s.aux_layer_ids is not None else default_aux_layers(L)
    layer_ids = validate_layer_ids(aux + [L], L)
    max_pos = getattr(text, "max_position_embeddings", None)
    splits = {sp: read_split(data_dir, sp, int(text.vocab_size), max_pos) for sp in SPLITS if split_files(data_dir, sp)}
    if s.heldout_data:
        splits["heldout"] = heldout_split(Path(s.heldout_data), target, int(text.vocab_size), max_pos)
    if not len(splits.get("train", ())):
        raise NestlingError(f"{data_dir} holds no training samples; check the data stage's output")
    index = {
        sp: [{"sample_id": i, "length": n} for i, n in zip(ts.sample_ids, ts.lengths())] for sp, ts in splits.items()
    }
    return Inputs(
        data_dir,
        m,
        target,
        target_fingerprint(target),
        cfg,
        aux,
        index["train"],
        index.get("heldout", []),
        online=OnlineData(data_dir, layer_ids, splits),
    )


def heldout_split(data_dir: Path, target: Path, vocab_size: int, max_pos: int | None) -> TokenSplit:
    """Every sample of another data folder as the held-out set, e.g. the target's own answers to
    held-out prompts: acceptance follows accuracy on the text the draft will meet when serving."""
    from nestling.capture.run import check_data_tokenizer
    from nestling.data.dataset import SPLITS, split_files
    from nestling.targets.load import load_tokenizer, tokenizer_fingerprint

    m = read_manifest(data_dir, "data")
    if (m.get("inputs") or {}).get("tokenizer"):
        check_data_tokenizer(data_dir, m, tokenizer_fingerprint(load_tokenizer(target)))
    parts = [read_split(data_dir, sp, vocab_size, max_pos) for sp in SPLITS if split_files(data_dir, sp)]
    if not parts or not sum(len(p) for p in parts):
        raise NestlingError(f"heldout_data {data_dir} holds no samples; check the data stage's output")
    ids = torch.cat([p.ids for p in parts])
    starts = torch.cat(
        [torch.zeros(1, dtype=torch.long)]
        + [
            p.starts[1:] + off
            for p, off in zip(parts, torch.tensor([0] + [int(p.starts[-1]) for p in parts]).cumsum(0).tolist())
        ]
    )
    return TokenSplit([i for p in parts for i in p.sample_ids], ids, torch.cat([p.mask for p in parts]), starts)


def supervised_ids(inp: "Inputs", split: str = "train"):
    """The supervised token ids of a split (the vocabulary's counts: train), from the data shards."""
    ts = inp.online.splits.get(split)
    if ts is not None:
        yield ts.ids[ts.mask]


def dataset(inp: "Inputs", split: str):
    """Items for `collate`: stored states offline, token ids only online."""
    if inp.online is not None:
        return inp.online.splits.get(split)
    from nestling.train.data import capture_dataset

    return capture_dataset(inp.capture_dir, split)


def key_extra(inp: "Inputs", s: "TrainSettings", device: torch.device) -> dict:
    """What an online run adds to the resume key: the data manifest (in place of the capture's, see
    plan._config_key), the layers and dtype the target runs with, and the marker itself, so an online
    checkpoint never resumes an offline run or the reverse. Offline keys are unchanged."""
    if inp.online is None:
        return {}
    return {"online": True, "layer_ids": inp.online.layer_ids, "target_dtype": target_dtype(s, device)}


def manifest_extra(inp: "Inputs", s: "TrainSettings", device: torch.device) -> dict:
    if inp.online is None:
        return {"inputs": {"capture": hash_json(inp.manifest)}, "capture_dir": str(Path(inp.capture_dir).resolve())}
    return {
        "inputs": {"data": hash_json(inp.manifest)},
        "data_dir": str(inp.online.data_dir.resolve()),
        "online": True,
        "target_dtype": target_dtype(s, device),
    }


# ---- the target in the loop -----------------------------------------------------------------------


class TargetStates:
    """The target on the training device: a packed CPU batch of token ids in, the same batch with its
    aux and final states (on the device, in the target's dtype) out."""

    def __init__(self, backend, budget: int):
        self.backend = backend  # capture's HFBackend (layer ids, dtype, device, no LM head, early stop)
        self.budget = budget

    def fill(self, b: PackedBatch) -> PackedBatch:
        """Run every sample of `b` (as collate cut it) through the target; padding gets zero states."""
        from nestling.capture.store import batches
        from nestling.data.dataset import Sample

        n, L = b.num_tokens, b.input_ids.shape[1]
        counts = torch.unique_consecutive(b.doc[0, :n], return_counts=True)[1].tolist()
        seqs = [x.tolist() for x in torch.split(b.input_ids[0, :n], counts)]
        # longest first in groups whose padded size fits the budget, as capture batches them: a
        # microbatch of one long and many short samples must not pad every short one to the long one;
        # a packed backend has no padding, so the whole microbatch (at most the budget) is one forward
        order = sorted(range(len(seqs)), key=lambda i: (-len(seqs[i]), i))
        ordered = [Sample("", i, seqs[i], []) for i in order]
        # (not while the first packed batch is being checked: the check runs it padded too)
        whole = self.backend.packed and not self.backend.packed_check_pending
        groups = [ordered] if whole else batches(ordered, self.budget)
        parts = [self.backend.capture([x.input_ids for x in g]) for g in groups]
        sorted_start, at = [0] * len(seqs), 0
        for i in order:
            sorted_start[i], at = at, at + len(seqs[i])
        src = torch.cat(
            [torch.arange(sorted_start[i], sorted_start[i] + len(seqs[i])) for i in range(len(seqs))]
            + [torch.arange(n, L)]
        )  # pad rows read the zero block appended below
        if L > n:
            parts.append(parts[0].new_zeros(L - n, *parts[0].shape[1:]))
        # outside inference mode: the result is an ordinary tensor the draft's autograd may save
        hidden = torch.cat(parts).index_select(0, self.backend.to_device(src))
        return PackedBatch(
            b.input_ids, b.loss_mask, b.doc, b.pos, hidden[:, :-1].reshape(L, -1)[None], hidden[:, -1][None], n
        )

    def close(self) -> None:
        self.backend.close()


def target_states(inp: "Inputs", s: "TrainSettings", device: torch.device) -> TargetStates | None:
    """The online run's target (loaded now, after every cheap check); None offline."""
    if inp.online is None:
        return None
    from nestling.capture.hf import HFBackend
    from nestling.capture.settings import CaptureSettings

    settings = CaptureSettings(device=str(device), dtype=target_dtype(s, device))
    return TargetStates(HFBackend(inp.target, inp.online.layer_ids, settings), s.batch_tokens)


# ---- `online: auto` (nestling run) ---------------------------------------------------------------


def target_weight_bytes(target: Path, dtype: str) -> int:
    """The target's weights in `dtype` (safetensors sizes, rescaled when stored wider or narrower; a
    quantized checkpoint at its dequantized parameter count, as load_model holds it)."""
    from nestling.targets.load import dense_parameter_count, load_config, quantized_load_kwargs

    width = {"float32": 4, "bfloat16": 2, "float16": 2}
    if quantized_load_kwargs(target):
        return dense_parameter_count(target) * width.get(dtype, 2)
    cfg = load_config(target)
    stored = str(getattr(cfg, "torch_dtype", None) or getattr(cfg, "dtype", None) or "bfloat16").replace("torch.", "")
    files = sum(p.stat().st_size for p in Path(target).glob("*.safetensors"))
    return int(files * width.get(dtype, 2) / width.get(stored, 2))


def draft_memory(
    trainable: int, hidden: int, vocab: int, inter: int, n_aux: int, draft_vocab: int, ttt_steps: int, batch_tokens: int
) -> dict[str, int]:
    """A rough upper bound of what training the draft holds on one device (docs/train.md), by part:
    fp32 weights, grads and Adam moments of the trainable part (16 B/param), the frozen embedding and
    teacher rows in bf16, the K steps' activations and draft-vocabulary logits of one microbatch plus
    the incoming states. Shared by `online: auto` and `nestling plan`."""
    H, dv, K, T = hidden, draft_vocab, ttt_steps, batch_tokens
    return {
        "weights_grads_adam": 16 * trainable,
        "frozen_embedding_teacher": 2 * vocab * H * 2,
        "activations": T * K * (dv * 4 * 2 + 40 * H * 4) + T * ((n_aux + 5) * H + 3 * inter) * 2,
    }


def draft_bytes_estimate(target: Path, s: "TrainSettings") -> int:
    """`draft_memory` summed for the draft `s` would train on `target`."""
    from nestling.draft.model import DraftConfig
    from nestling.draft.vocab import AUTO_MIN
    from nestling.targets.layers import default_aux_layers, num_layers
    from nestling.targets.load import load_config
    from nestling.train.settings import draft_norms

    config = load_config(target)
    text = getattr(config, "text_config", None) or config
    aux = list(s.aux_layer_ids) if s.aux_layer_ids else default_aux_layers(num_layers(config))
    c = DraftConfig.from_target(
        config,
        min(s.draft_vocab_size or AUTO_MIN, int(text.vocab_size)),
        aux,
        num_hidden_layers=s.draft_layers,
        **draft_norms(s),
    )
    if s.intermediate_size:
        c.intermediate_size = s.intermediate_size
    return sum(
        draft_memory(
            c.trainable_params(),
            c.hidden_size,
            c.vocab_size,
            c.intermediate_size,
            len(aux),
            c.draft_vocab_size,
            s.ttt_steps,
            s.batch_tokens,
        ).values()
    )


def choose_online(s: "TrainSettings", target: Path) -> tuple[bool, str]:
    """Resolve `online: auto` for `nestling run` and say why. On CUDA: online when the target's weights
    plus the draft's estimate fit in 90% of the free GPU memory (a capture store is then only a cost).
    On a CPU, where the target's forward costs as much online as in a capture, online only for a single
    pass (epochs <= 1, steps unset): more passes reread one store instead of rerunning the target."""
    from nestling.progress import format_bytes

    if s.online is True or s.online is False:
        return s.online, f"train.online is {str(s.online).lower()}"
    cuda = resolve_device(s.device) == "cuda"
    if not cuda:
        if s.steps is None and s.epochs <= 1:
            return True, (
                f"on a CPU a single pass (epochs {s.epochs:g}) runs the target once per token either way, "
                "and online stores nothing"
            )
        passes = f"steps {s.steps} may pass over the data more than once" if s.steps else f"epochs {s.epochs:g} > 1"
        return False, f"on a CPU the capture is computed once and reread every pass ({passes})"
    dev = torch.device("cuda", torch.cuda.current_device())
    need_t = target_weight_bytes(target, target_dtype(s, dev))
    need_d = draft_bytes_estimate(target, s)
    free = torch.cuda.mem_get_info(dev)[0]
    sizes = (
        f"target {format_bytes(need_t)} + draft ~{format_bytes(need_d)} against {format_bytes(free)} free "
        f"on {torch.cuda.get_device_name(dev)}"
    )
    if need_t + need_d <= 0.9 * free:
        return True, f"the target fits beside the draft ({sizes})"
    return False, f"the target does not fit beside the draft ({sizes}); capturing first"
