#!/usr/bin/env bash
# The flake campaign (issue 45): each 2-rank scenario of the suite N times, half of them beside two busy-loop
# processes that take both cores; pass/fail per run, every failure's output kept. Not part of the suite.
set -uo pipefail

usage() {
    cat <<'USAGE'
usage: bash scripts/repeat_two_rank.sh [--repo DIR] [--out DIR] [--runs N] [--first K] [SCENARIO...]

Runs each SCENARIO (default: all) N times (default 2), numbered from K (default 1; to add runs to an OUT) with the python of /work/main/.venv (PYTHON overrides), from
the checkout DIR (default: this one; PYTHONPATH=DIR, so a baseline worktree tests its own code). Odd runs meet an
idle machine, even runs two busy-loop processes. Each run takes /tmp/lf-2rank.lock for itself alone, so other 2-rank
jobs interleave. Writes OUT/results.tsv (scenario, run, load, status, seconds) and OUT/<scenario>-<run>.log for each
failed run; prints the counts.

Scenarios:
  fit-save-resume   tests/test_distributed.py: fit + save on 2 ranks, resumes on 2, on 1 and from 1 onto 2
  seq2seq           scripts/seq2seq_two_rank.py: mT5 LoRA, 20 steps at 32-true on 2 ranks, resume on 1, PEFT export
  preemption        the 2-rank tests of tests/test_preemption.py (-m slow)
  generation        tests/test_users_loops.py: generate() in validation on 2 ranks
USAGE
}

REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT=""
RUNS=2
FIRST=1
SCENARIOS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --repo) REPO="$(cd "$2" && pwd)"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --runs) RUNS="$2"; shift 2 ;;
        --first) FIRST="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) SCENARIOS+=("$1"); shift ;;
    esac
done
[ ${#SCENARIOS[@]} -gt 0 ] || SCENARIOS=(fit-save-resume seq2seq preemption generation)
OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/repeat_two_rank.XXXX")}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-/work/main/.venv/bin/python}"
# this script's own scenario file, run against the checkout under test
SEQ2SEQ="$(cd "$(dirname "$0")" && pwd)/seq2seq_two_rank.py"

command_of() {
    local pytest=("$PYTHON" -m pytest -x -q -p no:cacheprovider --basetemp="$2")
    case "$1" in
        fit-save-resume) echo "${pytest[*]} tests/test_distributed.py" ;;
        seq2seq) echo "$PYTHON $SEQ2SEQ --work $2" ;;
        preemption) echo "${pytest[*]} -m slow tests/test_preemption.py" ;;
        generation) echo "${pytest[*]} tests/test_users_loops.py::test_generate_in_validation_stays_in_step_and_uses_the_adapter" ;;
        *) echo "unknown scenario $1" >&2; exit 2 ;;
    esac
}

# one run, inside the lock: the busy loops (on an even run), the scenario, its status and time on stdout
one_run() {
    local load="$1" log="$2"; shift 2
    local spinners=()
    if [ "$load" = loaded ]; then
        for _ in 1 2; do "$PYTHON" -c "while True: pass" & spinners+=($!); done
    fi
    local begun=$SECONDS status
    (cd "$REPO" && PYTHONPATH="$REPO" timeout 1200 "$@") >"$log" 2>&1
    status=$?
    for pid in "${spinners[@]}"; do kill "$pid"; wait "$pid" 2>/dev/null; done
    echo "$status $((SECONDS - begun))"
}

[ -f "$OUT/results.tsv" ] || printf "scenario\trun\tload\tstatus\tseconds\n" >"$OUT/results.tsv"
for run in $(seq "$FIRST" $((FIRST + RUNS - 1))); do
    load=$([ $((run % 2)) -eq 1 ] && echo idle || echo loaded)
    for scenario in "${SCENARIOS[@]}"; do
        work="$(mktemp -d "$OUT/work.XXXX")"
        log="$OUT/$scenario-$run.log"
        read -r status seconds < <(
            export -f one_run; export PYTHON REPO
            flock /tmp/lf-2rank.lock bash -c 'one_run "$@"' _ "$load" "$log" $(command_of "$scenario" "$work")
        )
        printf "%s\t%s\t%s\t%s\t%s\n" "$scenario" "$run" "$load" "$status" "$seconds" >>"$OUT/results.tsv"
        echo "$scenario run $run ($load): status $status, ${seconds} s"
        [ "$status" = 0 ] && rm -f "$log"
        rm -rf "$work"
    done
done
echo "== $OUT/results.tsv"
awk -F'\t' 'NR > 1 { runs[$1]++; if ($4 != 0) failed[$1]++ }
    END { for (s in runs) printf "%-16s %d runs, %d failed\n", s, runs[s], failed[s] }' "$OUT/results.tsv"
