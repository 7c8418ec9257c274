#!/bin/sh
# A test whose judgement needs the command's output as well as its exit status, judged by this
# script's exit status alone (CTest's PASS_REGULAR_EXPRESSION would ignore the command's status).
# Usage: expect_output.sh [--fails] REGEX COMMAND [ARG...]
#   Runs COMMAND (stdout and stderr together, shown as they come), then exits 0 only when its
#   status is 0 (with --fails: non-zero) and its whole output matches the extended REGEX, in
#   which `.` also matches a newline (a NUL byte in the output reads as a space). Otherwise it exits 1 and says which of the two failed.
set -u
fails=0
if [ "${1:-}" = "--fails" ]; then fails=1; shift; fi
[ $# -ge 2 ] || { echo "usage: expect_output.sh [--fails] REGEX COMMAND [ARG...]" >&2; exit 2; }
regex=$1; shift
log=$(mktemp "${TMPDIR:-/tmp}/expect_output.XXXXXX") || exit 1
trap 'rm -f "$log"' EXIT
"$@" > "$log" 2>&1
status=$?
cat "$log"
if [ "$fails" = 1 ] && [ "$status" = 0 ]; then echo "expect_output: '$1' succeeded; it must fail"; exit 1; fi
if [ "$fails" = 0 ] && [ "$status" != 0 ]; then echo "expect_output: '$1' exited with status $status"; exit 1; fi
tr "\000" " " < "$log" | LC_ALL=C grep -aEzq -- "$regex" || { echo "expect_output: the output does not match: $regex"; exit 1; }
exit 0
