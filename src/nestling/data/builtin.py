"""Built-in training inputs a run config names: `builtin:sharegpt`, `builtin:maths`, `builtin:code`.

- `builtin:sharegpt`: the ShareGPT file of the package index (`nestling.assets`), as it is.
- `builtin:maths`: `MATHS_COUNT` questions from DeepMind's mathematics_dataset generator
  (`mathematics-dataset==1.0.1` on the package index), round-robin over its training modules at every
  difficulty, seeded; its short reference answer stands in as the assistant turn (`nestling regenerate`
  rewrites it in the target's words). The package needs sympy < 1.6, older than torch's, so nestling
  installs it once into an environment of its own in the cache (`MATHS_ENV`, every version pinned) and
  runs this file there as a script (its top level imports the standard library only).
- `builtin:code`: `CODE_COUNT` code requests built from the signatures and docstrings of the documented
  public functions of Python's standard library and of `CODE_PACKAGES` (installed with nestling), each
  asked in one of several wordings (`CODE_ASKS`), its `def` line the stand-in answer.

None of them overlaps nestling's evaluation sets: every generated conversation whose text shares a
run of `NGRAM` words (after `normalize`) with a HumanEval problem or a CHAMP problem
(`nestling.evaluate.domains`) is left out, and no HumanEval function name is asked about at all.
(MT-Bench's questions are not on the package index, so nestling cannot check against them.)

Each generated source is built once into the cache (`cache_dir()/builtin/NAME-vVERSION/`) and holds
`NAME.jsonl` and `manifest.json`: the source package(s) and versions, the count, the seed, the
conversations left out for overlap, and the JSONL's SHA-256. The same versions give the same bytes.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import io
import json
import os
import pkgutil
import random
import re
import sys
import warnings
from pathlib import Path
from types import ModuleType

MATHS_COUNT = 10_000  # the mix measured best (docs/results/quality.md): 10,000 maths questions
CODE_COUNT = 5_000  # ... and 5,000 code requests
SEED = 0
NGRAM = 10  # words in a shared run that counts as overlap with an evaluation prompt
BUILD_VERSION = 1  # bump when what a build writes changes: a new cache folder
MATHS_ENV = (
    "mathematics-dataset==1.0.1",
    "sympy==1.5.1",
    "mpmath==1.4.1",
    "numpy==1.23.5",  # 1.24 dropped np.object, 2.0 ndarray.itemset: both used by its polynomial modules
    "absl-py==2.5.1",
    "six==1.17.0",
)
NAMES = ("sharegpt", "maths", "code")


# ---- maths (runs inside the maths environment too: standard library at the top level only) ----------------


def maths_modules() -> list[tuple[str, object]]:
    """mathematics_dataset's training modules, flattened and sorted by name (a fixed order)."""
    from mathematics_dataset.modules import modules

    def flat(tree: dict, prefix: str = "") -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        for key, value in tree.items():
            name = f"{prefix}__{key}" if prefix else key
            out += flat(value, name) if isinstance(value, dict) else [(name, value)]
        return out

    return sorted(flat(modules.train(lambda r: r)), key=lambda kv: kv[0])


def make_deterministic() -> None:
    """mathematics_dataset 1.0.1 orders a composed question's statements by a set of objects (by memory
    address: different on every run); this replaces that one function with the same one in a fixed
    order (first seen), so a seed gives the same questions. String sets need PYTHONHASHSEED fixed too."""
    import six
    from mathematics_dataset.util import composition

    def expand_entities(context, **kwargs):
        kwargs = kwargs.copy()
        entities = list(context.child_entities)
        for key, maybe_entity in six.iteritems(kwargs):
            if isinstance(maybe_entity, composition.Entity):
                entities.append(maybe_entity)
                kwargs[key] = maybe_entity.handle
        entities = list(dict.fromkeys(entities))
        random.shuffle(entities)
        child_descriptions = []
        for entity in entities:
            child_descriptions.append(entity.child_description)
            if not entity.expression_used:
                child_descriptions.append(entity.description)
        return " ".join([s for s in child_descriptions if s]), kwargs

    composition.expand_entities = expand_entities


def maths_questions(n: int, seed: int = 0, max_chars: int = 160, mods: list | None = None) -> list[dict]:
    """`n` distinct questions as ShareGPT conversations, round-robin over the modules (`mods`: (name,
    problem maker) pairs; default mathematics_dataset's). The package is old: a few modules fail under
    today's numpy; a module that fails 20 times is dropped (named on stderr)."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    mods = list(mods) if mods is not None else maths_modules()
    seen: set[str] = set()
    out: list[dict] = []
    fails: dict[str, int] = {}
    while len(out) < n and mods:
        for name, make in list(mods):
            if len(out) >= n:
                break
            try:
                problem = make()
            except Exception as e:  # the package's own rot, not our input
                fails[name] = fails.get(name, 0) + 1
                if fails[name] >= 20:
                    print(f"[builtin] dropped maths module {name}: {type(e).__name__}: {e}", file=sys.stderr)
                    mods.remove((name, make))
                continue
            q, a = str(problem.question), str(problem.answer)
            if len(q) > max_chars or q in seen:
                continue
            seen.add(q)
            conv = [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
            out.append({"id": f"maths-{len(out)}", "module": name, "conversations": conv})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")


# ---- code ---------------------------------------------------------------------------------------------------

# Pure-Python packages whose documented functions make code requests, beside the standard library.
CODE_PACKAGES = ("networkx", "sympy")
# Standard-library modules left out: GUIs, demos, tests, installers and modules that act on import.
STDLIB_SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3"}
STDLIB_SKIP |= {"ensurepip", "venv", "pydoc_data", "__main__", "pip", "setuptools"}
# Several wordings, so the draft learns how the target writes code rather than one instruction.
CODE_ASKS = (
    "Complete the following Python function.\n\n```python\n{stub}\n```",
    "Implement this Python function. Reply with the whole function in a code block.\n\n```python\n{stub}\n```",
    "Write the body of this function:\n\n```python\n{stub}\n```",
    "Write a Python function `{name}{sig}`. {summary}",
    "How would you implement `{name}` in Python? Its documentation says:\n\n{doc}",
)


def _import_quietly(name: str) -> ModuleType | None:
    """The module, or None where importing it fails or prints (some stdlib modules act on import)."""
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            with contextlib.redirect_stderr(io.StringIO()):
                return importlib.import_module(name)
    except BaseException:  # noqa: BLE001 - SystemExit and friends from modules that are not libraries
        return None


def code_modules(packages: tuple[str, ...] = CODE_PACKAGES) -> list[ModuleType]:
    """The public standard-library modules and the public submodules of `packages`, by name."""
    names = [m for m in sys.stdlib_module_names if not m.startswith("_") and m not in STDLIB_SKIP]
    out: dict[str, ModuleType] = {}
    for name in sorted(names) + sorted(packages):
        mod = _import_quietly(name)
        if mod is None:
            continue
        out[name] = mod
        for info in pkgutil.walk_packages(getattr(mod, "__path__", []) or [], name + ".", onerror=lambda _: None):
            parts = info.name.split(".")
            if any(p.startswith("_") or p in ("tests", "test", "testing", "benchmarks") for p in parts[1:]):
                continue
            sub = _import_quietly(info.name)
            if sub is not None:
                out[info.name] = sub
    return [out[k] for k in sorted(out)]


def _documented(mod: ModuleType) -> list[tuple[str, object]]:
    """(qualified name, function) for the public functions and methods `mod` itself defines."""
    found: list[tuple[str, object]] = []
    for name, obj in sorted(vars(mod).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isfunction(obj):
            found.append((name, obj))
        elif inspect.isclass(obj):
            found += [
                (f"{name}.{a}", f)
                for a, f in sorted(vars(obj).items())
                if not a.startswith("_") and inspect.isfunction(f)
            ]
    return found


def code_request(name: str, fn: object, rng: random.Random, max_doc: int = 800) -> tuple[str, str] | None:
    """(request, stand-in answer: the `def` line) for one documented function, or None where it has
    no usable signature, docstring or source (a stub is its `def` line and docstring, cut at a paragraph)."""
    doc = inspect.getdoc(fn)
    try:
        sig, source = str(inspect.signature(fn)), inspect.getsource(fn)  # type: ignore[arg-type]
    except (TypeError, ValueError, OSError):
        return None
    if not doc or len(doc) < 40 or len(source) > 4000 or '"""' in doc or "<" in sig:  # "<": a default's repr
        return None
    while len(doc) > max_doc and "\n\n" in doc:
        doc = doc.rsplit("\n\n", 1)[0]
    if len(doc) > max_doc:
        return None
    short = name.rsplit(".", 1)[-1]
    body = "\n".join("    " + line if line else "" for line in doc.splitlines())
    stub = f'def {short}{sig}:\n    """\n{body}\n    """'
    ask = rng.choice(CODE_ASKS)
    summary = doc.split("\n\n", 1)[0].replace("\n", " ")
    return ask.format(stub=stub, name=short, sig=sig, summary=summary, doc=doc), f"def {short}{sig}:"


def code_questions(
    n: int, seed: int = 0, modules: list[ModuleType] | None = None, exclude: frozenset[str] = frozenset()
) -> list[dict]:
    """Up to `n` code requests as ShareGPT conversations, one per documented function, drawn
    round-robin from the standard library and each package (so no one large package dominates), each
    group in a seeded shuffle; `exclude`: function names never asked (the held-out code prompts' own)."""
    rng = random.Random(seed)
    groups: dict[str, list[dict]] = {}
    seen: set[str] = set()
    for mod in modules if modules is not None else code_modules():
        top = mod.__name__.split(".")[0]
        group = groups.setdefault("stdlib" if top in sys.stdlib_module_names else top, [])
        for name, fn in _documented(mod):
            short = name.rsplit(".", 1)[-1]
            made = None if short in exclude else code_request(name, fn, rng)
            if made is None or made[0] in seen:
                continue
            seen.add(made[0])
            conv = [{"from": "human", "value": made[0]}, {"from": "gpt", "value": made[1]}]
            group.append({"id": f"code-{mod.__name__}.{name}", "module": mod.__name__, "conversations": conv})
    queues = [groups[k] for k in sorted(groups) if groups[k]]
    for q in queues:
        rng.shuffle(q)
    out: list[dict] = []
    while len(out) < n and queues:
        out += [q.pop() for q in queues][: n - len(out)]
        queues = [q for q in queues if q]
    return out


# ---- overlap with the evaluation sets ------------------------------------------------------------------------

_WORD = re.compile(r"[a-z0-9]+")


def normalize(text: str) -> list[str]:
    """The words of `text`: lower case, letters and digits only (punctuation, markup, spacing dropped)."""
    return _WORD.findall(text.lower())


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    """Every run of `n` words of `text` (the whole text where it is shorter, but not empty)."""
    w = normalize(text)
    if 0 < len(w) < n:
        return {tuple(w)}
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


def eval_texts() -> dict[str, list[str]]:
    """The evaluation sets' own texts, without nestling's instructions around them: HumanEval's
    prompts (signature and docstring) and CHAMP's problems."""
    from nestling.evaluate.domains import CODE_ASK, MATHS_ASK, domain_prompts

    code = [p.removeprefix(CODE_ASK).removeprefix("```python\n").removesuffix("\n```") for p in domain_prompts("code")]
    maths = [p.removeprefix(MATHS_ASK) for p in domain_prompts("maths")]
    return {"humaneval": code, "champ": maths}


def informative(gram: tuple[str, ...]) -> bool:
    """Whether a run of words is a text's own: at least half its words are words of three letters or
    more. Runs of numbers and single letters (`0 1 2 3 4 5 6 7 8 9`, `grid 1 2 3 ...`) are in many texts
    and no problem's own; every ShareGPT conversation that shares a run with the evaluation sets shares
    only such a run."""
    return 2 * sum(len(w) >= 3 and w.isalpha() for w in gram) >= len(gram)


@functools.lru_cache(maxsize=2)
def eval_ngrams(n: int = NGRAM) -> frozenset[tuple[str, ...]]:
    """The informative n-grams of every evaluation text."""
    grams: set[tuple[str, ...]] = set()
    for texts in eval_texts().values():
        for t in texts:
            grams |= {g for g in ngrams(t, n) if informative(g)}
    return frozenset(grams)


def conversation_text(row: dict) -> str:
    return "\n".join(
        str(m.get("value", m.get("content", ""))) for m in row.get("conversations", row.get("messages", []))
    )


def overlapping(rows: list[dict], grams: frozenset[tuple[str, ...]], n: int = NGRAM) -> list[dict]:
    """The rows whose text shares a run of `n` words with `grams`."""
    return [r for r in rows if ngrams(conversation_text(r), n) & grams]


def heldout_code_names() -> set[str]:
    """The function names of the code domain's prompts (HumanEval's entry points)."""
    import gzip

    from nestling.assets import humaneval_jsonl

    with gzip.open(humaneval_jsonl(), "rt", encoding="utf-8") as f:
        return {json.loads(line)["entry_point"] for line in f if line.strip()}


# ---- building into the cache -------------------------------------------------------------------------------


def source_dir(name: str) -> Path:
    """The cache folder of a generated source (whether built or not)."""
    from nestling.assets import cache_dir

    return cache_dir() / "builtin" / f"{name}-v{BUILD_VERSION}"


def maths_python() -> Path:
    """The Python of the maths environment, made once in the cache (a venv with `MATHS_ENV` installed
    from the package index)."""
    import subprocess

    from nestling.assets import build_once, cache_dir
    from nestling.errors import NestlingError
    from nestling.progress import log

    def build(tmp: Path) -> None:
        import venv

        log(f"[builtin] making the maths environment ({', '.join(MATHS_ENV)}) in {tmp.parent} ...")
        venv.EnvBuilder(with_pip=True).create(tmp)
        cmd = [str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", "--no-input", *MATHS_ENV]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise NestlingError(
                f"could not install {' '.join(MATHS_ENV)} from the package index for builtin:maths:\n"
                + r.stderr.strip()[-2000:]
            )

    env = build_once(cache_dir() / "envs" / "mathematics-dataset-1.0.1", build, marker="pyvenv.cfg")
    return env / "bin" / "python"


def _finish(tmp: Path, name: str, rows: list[dict], manifest: dict) -> None:
    """Write `rows` (less those overlapping the evaluation sets) and the manifest into `tmp`."""
    from nestling.assets import sha256_file
    from nestling.manifest import atomic_write_json

    dropped = overlapping(rows, eval_ngrams())
    ids = {id(r) for r in dropped}
    kept = [r for r in rows if id(r) not in ids]
    path = tmp / f"{name}.jsonl"
    write_jsonl(path, kept)
    manifest.update(
        source=name,
        build_version=BUILD_VERSION,
        generated=len(rows),
        count=len(kept),
        left_out_for_eval_overlap=[r["id"] for r in dropped],
        overlap_check=f"no run of {NGRAM} normalized words shared with HumanEval's prompts or CHAMP's problems",
        file=path.name,
        sha256=sha256_file(path),
    )
    atomic_write_json(tmp / "manifest.json", manifest)


def build_maths(n: int = MATHS_COUNT, seed: int = SEED, python: Path | None = None) -> Path:
    """The maths source's JSONL, built once (in the maths environment: `maths_python`)."""
    import subprocess

    from nestling.assets import build_once
    from nestling.errors import NestlingError
    from nestling.progress import log

    out = source_dir("maths") if (n, seed) == (MATHS_COUNT, SEED) else source_dir(f"maths-{n}-s{seed}")

    def build(tmp: Path) -> None:
        py = python or maths_python()
        tmp.mkdir(parents=True, exist_ok=True)
        raw = tmp / "generated.jsonl"
        log(f"[builtin] generating {n:,} maths questions (mathematics-dataset 1.0.1, seed {seed}) ...")
        # run_path, not `python builtin.py`: the script's folder must not be on sys.path (data/inspect.py
        # would shadow the standard library's); PYTHONHASHSEED: set orders of strings fixed
        argv = ["builtin", "maths", str(n), str(seed), str(raw)]
        code = f"import runpy, sys; sys.argv = {argv!r}; runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')"
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        r = subprocess.run([str(py), "-W", "ignore", "-c", code], capture_output=True, text=True, cwd=tmp, env=env)
        if r.returncode != 0:
            raise NestlingError(f"builtin:maths: the generator failed:\n{r.stderr.strip()[-2000:]}")
        rows = [json.loads(line) for line in raw.read_text().splitlines() if line.strip()]
        raw.unlink()
        _finish(tmp, "maths", rows, {"packages": list(MATHS_ENV), "seed": seed, "requested": n})

    return build_once(out, build, marker="manifest.json") / "maths.jsonl"


def build_code(n: int = CODE_COUNT, seed: int = SEED, modules: list[ModuleType] | None = None) -> Path:
    """The code source's JSONL, built once (from the standard library and `CODE_PACKAGES`)."""
    from importlib.metadata import version

    from nestling.assets import build_once
    from nestling.progress import log

    out = source_dir("code") if (n, seed, modules) == (CODE_COUNT, SEED, None) else source_dir(f"code-{n}-s{seed}")

    def build(tmp: Path) -> None:
        log(f"[builtin] building {n:,} code requests from the standard library and {', '.join(CODE_PACKAGES)} ...")
        rows = code_questions(n, seed, modules, exclude=frozenset(heldout_code_names()))
        tmp.mkdir(parents=True, exist_ok=True)
        packages = [f"python=={sys.version.split()[0]}"] + [f"{p}=={version(p)}" for p in CODE_PACKAGES]
        _finish(tmp, "code", rows, {"packages": packages, "seed": seed, "requested": n})

    return build_once(out, build, marker="manifest.json") / "code.jsonl"


def resolve(name: str) -> Path:
    """The local file of one built-in input (built or fetched once)."""
    from nestling import assets

    if name == "sharegpt":
        return assets.sharegpt_json()
    if name == "maths":
        return build_maths()
    if name == "code":
        return build_code()
    from nestling.errors import NestlingError

    raise NestlingError(f"unknown built-in input {name!r}; known: {', '.join('builtin:' + n for n in NAMES)}")


def expected_path(name: str) -> Path:
    """Where `builtin:NAME`'s file lies once made (nothing is built): how `data.weights` names it."""
    from nestling.assets import SHAREGPT_JSON, cache_dir

    if name == "sharegpt":
        return cache_dir() / "assets" / SHAREGPT_JSON.name
    return source_dir(name) / f"{name}.jsonl"


if __name__ == "__main__":  # inside the maths environment: `python builtin.py maths N SEED OUT`
    _, what, count, seed_, dest = sys.argv
    assert what == "maths"
    make_deterministic()
    write_jsonl(Path(dest), maths_questions(int(count), int(seed_)))
