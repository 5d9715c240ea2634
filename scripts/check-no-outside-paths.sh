#!/usr/bin/env bash
# Fail when a file points outside the repository, at the developers' notes that users never get.
#
#   scripts/check-no-outside-paths.sh            check every file git tracks in this repository
#   scripts/check-no-outside-paths.sh -C DIR     check every file git tracks in the repository at DIR
#   scripts/check-no-outside-paths.sh FILE...    check these files only
#
# Flagged: a parent-relative path into the developers' `shared` folder, and that folder's
# reference notes, traces, design and style notes, and reference data (the exact patterns are
# PATTERN below). Each hit is printed as file:line:text; rc 1 if any, 0 if none, 2 on bad usage.
# The fix is to point at what ships with the repository: docs/reference/*.md, common/data/.
set -euo pipefail

# Written so that this file does not match itself: `\.` and `[-]` never match their own text.
PATTERN='\.\./shared|shared/(reference|traces|DESIGN|STYLE)|reference[-]data'

say() { printf '[check-no-outside-paths] %s\n' "$*" >&2; }
usage() { sed -n '2,11p' "$0" >&2; }

root=""
files=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -C) [[ $# -ge 2 ]] || { say "-C needs a directory"; exit 2; }; root="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; files+=("$@"); break ;;
    -*) say "unknown option: $1 (see --help)"; exit 2 ;;
    *) files+=("$1"); shift ;;
  esac
done
if [[ -n "$root" && ${#files[@]} -gt 0 ]]; then
  say "give either -C DIR or files, not both"; exit 2
fi

set +e
if [[ ${#files[@]} -gt 0 ]]; then
  for f in "${files[@]}"; do
    [[ -f "$f" ]] || { say "no such file: $f"; exit 2; }
  done
  hits="$(grep -n -I -H -E -e "$PATTERN" -- "${files[@]}")"
  rc=$?
else
  root="${root:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
  if ! git -C "$root" rev-parse --git-dir >/dev/null 2>&1; then
    say "not a git repository: $root (pass files instead)"; exit 2
  fi
  hits="$(git -C "$root" grep -n -I -E -e "$PATTERN" -- .)"
  rc=$?
fi
set -e

case $rc in
  0)
    printf '%s\n' "$hits"
    say "$(printf '%s\n' "$hits" | wc -l) line(s) point outside the repository; users do not have" \
        "those files: point at docs/reference/*.md or common/data/ instead"
    exit 1 ;;
  1) exit 0 ;;  # grep: no match
  *) say "grep failed (rc $rc)"; exit 2 ;;
esac
