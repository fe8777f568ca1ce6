"""The vLLM backend: the target runs in vLLM, in-process, through public extension points only.

vLLM's speculative method `extract_hidden_states` makes the engine keep the states of chosen layers
for every prompt token; nestling's own KV connector (`vllm_connector.py`, loaded by module path)
writes them straight into the shard being filled. We never touch vLLM's scheduler, request or worker
classes: the engine is `vllm.LLM`, requests are `TokensPrompt` + `SamplingParams`, and each request
carries its destination (shard file and byte offset) in `SamplingParams.extra_args["kv_transfer_params"]`.

Layer ids (`targets.layers.vllm_layer_ids`): vLLM's aux id k is HF `hidden_states[k]` for 0 < k < L
(so nestling's ids pass unchanged), but id L is the last layer's output *before* the final norm. The
connector applies the target's final norm (`model.norm.weight`, read here) to that last id, so the
shard holds post-norm states like the hf backend (`final_state: "post_norm"`). The parity test
against the hf backend pins this down.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from nestling.capture.backend import Backend
from nestling.capture.settings import CaptureSettings
from nestling.errors import NestlingError
from nestling.targets.layers import vllm_layer_ids
from nestling.targets.vllm_rules import (
    HF_HINT,
    attention_backend,
    check_cpu_target,
    is_mla,
    model_type,
    spawn_engine_processes,
)
from nestling.vllm_compat import require

CONNECTOR = "NestlingHiddenStatesConnector"
CONNECTOR_MODULE = "nestling.capture.vllm_connector"


def check_target(config: dict) -> None:
    """Refuse targets this vLLM path cannot capture, before spending minutes loading them.

    MLA targets (DeepSeek-V2/V3, Kimi-K2 and K2.5) are captured: their states match transformers' to
    float32 rounding (tests/test_capture_vllm_mla.py; docs/capture-vllm.md, "MLA targets"). DeepSeek-V4 is
    refused: its model-specific KV packing swallows the hidden-state cache (vLLM #53074). On a CPU,
    `check_cpu_target` adds the limits of vLLM's CPU build.
    """
    kind = model_type(config)
    if kind == "deepseek_v4":
        raise NestlingError(
            f"the vllm capture backend refuses {kind} targets: vLLM groups DeepSeek-V4's KV "
            f"cache so that the hidden-state cache is lost (vLLM #53074); {HF_HINT}."
        )
    if config.get("is_encoder_decoder"):
        raise NestlingError(f"the vllm capture backend handles decoder-only targets, not {kind}; {HF_HINT}.")


def final_norm(target: Path, config: dict) -> dict:
    """The target's final norm as the connector applies it (weight as a list: it travels in JSON)."""
    from nestling.targets.load import read_tensors

    text = config.get("text_config") or config
    kind = text.get("model_type", config.get("model_type", ""))
    names = ["model.norm.weight", "model.language_model.norm.weight"]  # causal LM, multimodal wrapper
    w = None
    for name in names:
        try:
            w = read_tensors(target, [name])[name].float()
            break
        except NestlingError:
            continue
    if w is None:
        raise NestlingError(f"target {target} has no final norm weight (looked for {names}); {HF_HINT}")
    eps = text.get("rms_norm_eps", text.get("layer_norm_eps", 1e-6))
    return {"weight": w.tolist(), "eps": float(eps), "plus_one": kind.startswith("gemma")}


def embedding_source(target: Path) -> dict:
    """Where the connector reads the embedding rows it writes for id 0: the checkpoint file and tensor."""
    from nestling.targets.load import head_tensor_names, tensor_file

    name = head_tensor_names(target)["embed"]
    return {"file": str(tensor_file(target, name)), "name": name}


def _engine_settings(settings: CaptureSettings, config: dict) -> CaptureSettings:
    """The engine's attention backend where nestling must choose it (targets/vllm_rules.py)."""
    import dataclasses

    if settings.attention_backend is None:
        backend = attention_backend(config, settings.dtype, _on_cpu(settings.device))
        if backend:
            return dataclasses.replace(settings, attention_backend=backend)
    return settings


class VLLMBackend(Backend):
    """vLLM in-process; `fill(path, seqs, offsets)` makes the engine write rows into a shard file.

    `capture(seqs)` (the generic interface) goes through a scratch file and returns the rows; the
    runner calls `write_shard`, which fills shard files without the round trip. With
    `data_parallel_size` N > 1 there are N independent engines (vLLM 0.32 refuses
    `LLM(data_parallel_size>1)` in one process), each in its own process on its own
    `tensor_parallel_size` GPUs; every shard's samples are split between them, and they write
    disjoint byte ranges of the same file.
    """

    writes_shards = True

    def __init__(self, target: Path, layer_ids: list[int], settings: CaptureSettings):
        require(HF_HINT)
        target = Path(target)
        config = json.loads((target / "config.json").read_text())
        check_target(config)
        if _on_cpu(settings.device):
            check_cpu_target(config)
        text = config.get("text_config") or config
        self.n_layers = int(text["num_hidden_layers"])
        self.layer_ids = list(layer_ids)
        engine_ids = vllm_layer_ids(self.layer_ids, self.n_layers)  # refuses ids the target does not have
        self.hidden_size = int(text["hidden_size"])
        self.dtype = getattr(torch, settings.dtype)
        self.device = torch.device("cpu")  # rows arrive in host files, never as device tensors
        max_pos = int(text.get("max_position_embeddings", 1 << 30))
        # +2: vLLM counts the one output token and the speculative slot into a request's length
        self.max_model_len = min(int(settings.max_model_len or settings.token_budget) + 2, max_pos)
        self._scratch: Path | None = None
        extra = {"dtype": settings.dtype}
        if self.layer_ids[-1] == self.n_layers:
            extra["final_norm"] = final_norm(target, config)
        if self.layer_ids[0] == 0 and is_mla(config):
            # vLLM's deepseek_v2 backbone cannot return id 0 (it adds a residual that does not exist yet
            # before the first layer); the connector writes those rows from the embedding table instead
            engine_ids = engine_ids[1:]
            extra["embed"] = embedding_source(target)
        settings = _engine_settings(settings, config)
        dp = int(settings.data_parallel_size)
        if dp == 1:
            self.engines = [_Engine(target, engine_ids, settings, self.max_model_len, extra)]
        else:
            tp = int(settings.tensor_parallel_size)
            gpus = _visible_gpus() if not _on_cpu(settings.device) else []
            if gpus and len(gpus) < dp * tp:
                raise NestlingError(
                    f"data_parallel_size {dp} x tensor_parallel_size {tp} needs {dp * tp} GPUs; {len(gpus)} are visible"
                )
            self.engines = [
                _Replica(
                    target,
                    engine_ids,
                    settings,
                    self.max_model_len,
                    extra,
                    gpus[r * tp : (r + 1) * tp] if gpus else None,
                )
                for r in range(dp)
            ]
            for e in self.engines:
                e.ready()

    @property
    def row_bytes(self) -> int:
        return len(self.layer_ids) * self.hidden_size * self.dtype.itemsize

    def fill(self, path: Path, seqs: list[list[int]], offsets: list[int], sample_ids: list[str] | None = None) -> None:
        """Prefill `seqs` (one output token each); sample i's rows land at byte `offsets[i]` of `path`.

        Returns when vLLM has finished every request, i.e. when every row is in the file."""
        for s in seqs:
            if not 0 < len(s) < self.max_model_len:
                raise NestlingError(
                    f"a sample of {len(s)} tokens does not fit the vLLM engine's max_model_len {self.max_model_len}; "
                    f"raise max_model_len (default: the longest sample) or token_budget"
                )
        ids = sample_ids or [str(i) for i in range(len(seqs))]
        work = [(list(s), str(path), int(o), sid) for s, o, sid in zip(seqs, offsets, ids)]
        if len(self.engines) == 1:
            self.engines[0].fill(work)
            return
        parts: list[list] = [[] for _ in self.engines]
        load = [0] * len(self.engines)
        for w in sorted(work, key=lambda w: -len(w[0])):  # longest first onto the least loaded engine
            r = load.index(min(load))
            parts[r].append(w)
            load[r] += len(w[0])
        busy = [e for e, part in zip(self.engines, parts) if part]
        for e, part in zip(self.engines, parts):
            if part:
                e.send(part)
        for e in busy:
            e.wait()

    def write_shard(self, path: Path, plan, meta: dict, token_budget: int, on_batch=None) -> None:
        """Write one planned shard: header, token ids and mask from here; hidden rows from the engine.

        The file is built under the store's temporary name and renamed when every row is in, exactly
        like the hf backend's shards (same header, so the same plan key makes resume work alike)."""
        from nestling.capture.store import _header, batches, file_crc32, record_checksum

        n_ids, T = len(self.layer_ids), plan.tokens
        header = _header(plan, n_ids, self.hidden_size, self.dtype, {**meta, "plan": plan.key})
        tmp = Path(path).with_name(f".{Path(path).name}.tmp")
        base = len(header)
        ids = torch.tensor([t for s in plan.samples for t in s.input_ids], dtype=torch.int32)
        mask = torch.tensor([t for s in plan.samples for t in s.loss_mask], dtype=torch.uint8)
        with open(tmp, "wb") as f:
            f.write(header)
            f.truncate(base + T * self.row_bytes)  # the rows' region; the connector fills it in place
            f.seek(base + T * self.row_bytes)
            f.write(ids.numpy().tobytes())
            f.write(mask.numpy().tobytes())
        starts, off = {}, 0
        for s in plan.samples:
            starts[s.sample_id] = off
            off += len(s.input_ids)
        for batch in batches(plan.samples, token_budget):
            self.fill(
                tmp,
                [s.input_ids for s in batch],
                [base + starts[s.sample_id] * self.row_bytes for s in batch],
                [s.sample_id for s in batch],
            )
            if on_batch is not None:
                on_batch(batch)
        _check_rows_written(
            tmp, base, self.row_bytes, [(s.sample_id, starts[s.sample_id], len(s.input_ids)) for s in plan.samples]
        )
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())  # the worker's writes too: fsync flushes the file, whoever wrote it
        record_checksum(Path(path).parent, Path(path).name, plan.key, *file_crc32(tmp))  # the engine wrote the rows
        os.replace(tmp, path)

    def capture(self, seqs: list[list[int]]) -> torch.Tensor:
        lengths = [len(s) for s in seqs]
        n = sum(lengths)
        if self._scratch is None:
            fd, name = tempfile.mkstemp(prefix="nestling-vllm-", suffix=".bin")
            os.close(fd)
            self._scratch = Path(name)
        with open(self._scratch, "r+b") as f:
            f.truncate(n * self.row_bytes)
        offsets, off = [], 0
        for length in lengths:
            offsets.append(off * self.row_bytes)
            off += length
        self.fill(self._scratch, seqs, offsets)
        raw = torch.from_file(str(self._scratch), size=n * self.row_bytes, dtype=torch.uint8)
        return raw.view(self.dtype).view(n, len(self.layer_ids), self.hidden_size).clone()

    def close(self) -> None:
        if self._scratch is not None:
            self._scratch.unlink(missing_ok=True)
            self._scratch = None
        for e in getattr(self, "engines", []):
            e.close()
        self.engines = []


def cpu_thread_binding(tp: int, cpus: list[int], numa_nodes: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` CPU workers, or None where vLLM's own binding works.

    vLLM's CPU build binds each tensor-parallel worker's OpenMP threads to CPUs; its automatic binding
    gives every worker a NUMA node of its own and fails with fewer nodes than workers
    (`utils/ompmultiprocessing.py:217-222`, "Not enough allowed NUMA nodes"). Then the CPUs this process may
    use are split into `tp` runs of consecutive CPUs, one per worker ("0,1|2,3")."""
    if tp <= 1 or numa_nodes >= tp:
        return None
    if len(cpus) < tp:
        raise NestlingError(
            f"tensor_parallel_size {tp} on vLLM's CPU build needs at least {tp} CPUs (one per worker); this "
            f"process may use {len(cpus)}. Lower tensor_parallel_size, or set VLLM_CPU_OMP_THREADS_BIND yourself"
        )
    cpus, n = sorted(cpus), len(cpus) // tp
    return "|".join(",".join(map(str, cpus[r * n : (r + 1) * n])) for r in range(tp))


def _numa_nodes() -> int:
    return max(1, len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))))


class _Engine:
    """One `vllm.LLM` in this process, configured for capture."""

    def __init__(self, target: Path, layer_ids: list[int], settings: CaptureSettings, max_model_len: int, extra: dict):
        on_cpu = _on_cpu(settings.device)
        if on_cpu:  # the CPU build sizes its KV cache from this variable (GiB), not from a memory fraction
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(settings.vllm_kv_cache_gib)))  # whole GiB
            bind = cpu_thread_binding(
                int(settings.tensor_parallel_size), sorted(os.sched_getaffinity(0)), _numa_nodes()
            )
            if bind is not None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
        else:
            spawn_engine_processes()
        from vllm import LLM

        from nestling.vllm_logs import quiet_harmless_vllm_logs

        quiet_harmless_vllm_logs()  # the chat-template warm-up's traceback where no tokenizer is loaded
        self.llm = LLM(
            model=str(target),
            tokenizer=str(target),
            skip_tokenizer_init=True,  # we send token ids; nothing is detokenized
            dtype=settings.dtype,
            tensor_parallel_size=int(settings.tensor_parallel_size),
            max_model_len=max_model_len,
            # Correctness: each prompt must be computed whole, in the step it is first scheduled, so that
            # the connector sees a request's every row when it is new. Chunked prefill would split long
            # prompts over steps, and prefix caching would skip computing shared prefixes.
            enable_chunked_prefill=False,
            enable_prefix_caching=False,
            max_num_batched_tokens=max(settings.token_budget, max_model_len),
            enforce_eager=on_cpu,
            seed=0,
            enable_expert_parallel=bool(settings.enable_expert_parallel),
            **({"attention_config": {"backend": settings.attention_backend}} if settings.attention_backend else {}),
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
            },
            kv_transfer_config={
                "kv_connector": CONNECTOR,
                "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": extra,
            },
        )

    def fill(self, work: list[tuple[list[int], str, int, str]]) -> None:
        """`work`: (token ids, shard path, byte offset, sample id) per request."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from nestling.capture.vllm_connector import OFFSET, PATH, SAMPLE

        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _, _, _ in work]
        params = [
            SamplingParams(
                max_tokens=1,
                temperature=0.0,
                detokenize=False,
                extra_args={"kv_transfer_params": {PATH: path, OFFSET: off, SAMPLE: sid}},
            )
            for _, path, off, sid in work
        ]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        if len(outs) != len(work) or any(not o.finished for o in outs):
            raise NestlingError("vLLM returned fewer finished requests than were sent; the shard is incomplete")

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass


def _replica_main(conn, target, layer_ids, settings, max_model_len, extra, gpus) -> None:
    """A data-parallel replica: its own engine on its own GPUs, filling what the main process sends."""
    if gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    try:
        engine = _Engine(target, layer_ids, settings, max_model_len, extra)
        conn.send(("ready", None))
    except BaseException as e:  # noqa: BLE001 - reported to the main process as text
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    while True:
        msg = conn.recv()
        if msg is None:
            break
        try:
            engine.fill(msg)
            conn.send(("ok", None))
        except BaseException as e:  # noqa: BLE001
            conn.send(("error", f"{type(e).__name__}: {e}"))
    engine.close()


class _Replica:
    def __init__(self, target, layer_ids, settings, max_model_len, extra, gpus):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_replica_main,
            name="nestling-vllm-replica",
            args=(child, target, layer_ids, settings, max_model_len, extra, gpus),
        )
        self.proc.start()

    def _recv(self) -> None:
        while not self.conn.poll(1.0):
            if not self.proc.is_alive():
                raise NestlingError(f"a vLLM data-parallel replica died (exit code {self.proc.exitcode})")
        kind, err = self.conn.recv()
        if kind == "error":
            raise NestlingError(f"a vLLM data-parallel replica failed: {err}")

    ready = wait = _recv

    def send(self, work) -> None:
        self.conn.send(work)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(60)
        if self.proc.is_alive():
            self.proc.terminate()


def _visible_gpus() -> list[int]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env:
        return [int(x) for x in env.split(",") if x.strip()]
    return list(range(torch.cuda.device_count()))


def _check_rows_written(path: Path, base: int, row_bytes: int, spans: list[tuple[str, int, int]]) -> None:
    """Every sample's first and last row must be non-zero: a row the connector never wrote reads as zeros
    (the region is preallocated), and that must fail here rather than train a draft on zeros."""
    with open(path, "rb") as f:
        for sid, start, n in spans:
            for r in (start, start + n - 1):
                f.seek(base + r * row_bytes)
                if not any(f.read(row_bytes)):
                    raise NestlingError(
                        f"vLLM finished sample {sid} but its hidden states never reached the shard; "
                        f"the engine's KV connector did not run (is this vLLM in the tested range?)"
                    )


def _on_cpu(device: str) -> bool:
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())
