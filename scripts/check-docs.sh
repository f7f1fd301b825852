#!/usr/bin/env bash
# Checks the commands and the links of README.md and docs/*.md.
#
# Every fenced ```sh block (```bash and ```shell too) starts with one of three marker lines:
#
#   # check: run    this script runs the block, from the repository's root, with
#                   `bash -euo pipefail` and a time limit. Such a block must be cheap: seconds
#                   on release builds (`cargo run --release -q -p PACKAGE -- ...`, small sizes),
#                   each command inside `timeout 120`.
#   # check: parse  the block needs a cluster, root, a GPU or a batch system, so it is not run:
#                   every psnet-* program it starts (psnet-launch, psnet-train, psnet-perf,
#                   psnet-sim, psnet-doctor, any other) must be a binary of this workspace, every
#                   `cargo -p PACKAGE` a package of it, and every long option (--foo) given to a
#                   psnet binary must appear in that binary's source (`long = "foo"`, an alias,
#                   a literal "--foo", or a field foo / foo_bar under `#[arg(long ...)]`).
#   # check: ci     CI runs this block itself (the README's two commands): skipped here.
#
# A block without a marker is a failure. `run` blocks get the `parse` checks too. Every
# relative link and image in README.md and docs/*.md must name an existing file, and a
# #fragment must name a heading of the Markdown file it points to (GitHub's slugs).
#
# Usage: bash scripts/check-docs.sh [--no-run]     --no-run: the parse checks and links only.
# Time: CHECK_DOCS_BLOCK_TIMEOUT (seconds per run block, default 300) and CHECK_DOCS_TIMEOUT
# (seconds for the whole script, default 1200). Prints one line per block and per linking
# file, then a summary; exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

RUN_BLOCKS=1
case "${1:-}" in
  --no-run) RUN_BLOCKS=0 ;;
  "") ;;
  *) echo "usage: bash scripts/check-docs.sh [--no-run]" >&2; exit 2 ;;
esac
BLOCK_TIMEOUT=${CHECK_DOCS_BLOCK_TIMEOUT:-300}
TOTAL_TIMEOUT=${CHECK_DOCS_TIMEOUT:-1200}
START=$SECONDS

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

DOCS=(README.md)
for f in docs/*.md; do if [ -e "$f" ]; then DOCS+=("$f"); fi; done

failures=0
fail() { echo "FAIL $*"; failures=$((failures + 1)); }

# --- The workspace's packages and binaries -------------------------------------------------
# $WORK/pkgs: "PACKAGE DIR"; $WORK/bins: "BINARY DIR" (DIR: the package's folder).
: > "$WORK/pkgs"
: > "$WORK/bins"
for toml in */Cargo.toml; do
  dir=${toml%/Cargo.toml}
  [ "$dir" = target ] && continue
  pkg=$(awk '/^\[package\]/ { p = 1; next } /^\[/ { p = 0 }
             p && /^name[ \t]*=/ { gsub(/^name[ \t]*=[ \t]*"|".*$/, ""); print; exit }' "$toml")
  [ -n "$pkg" ] || continue
  echo "$pkg $dir" >> "$WORK/pkgs"
  awk '/^\[\[bin\]\]/ { b = 1; next } /^\[/ { b = 0 }
       b && /^name[ \t]*=/ { gsub(/^name[ \t]*=[ \t]*"|".*$/, ""); print }' "$toml" |
    while read -r bin; do echo "$bin $dir"; done >> "$WORK/bins"
  if [ -f "$dir/src/main.rs" ]; then echo "$pkg $dir" >> "$WORK/bins"; fi
  for b in "$dir"/src/bin/*.rs; do
    if [ -e "$b" ]; then b=${b##*/}; echo "${b%.rs} $dir" >> "$WORK/bins"; fi
  done
done
sort -u -o "$WORK/bins" "$WORK/bins"

bin_dir() { awk -v b="$1" '$1 == b { print $2; exit }' "$WORK/bins"; }

# Whether option NAME (without the dashes) is defined in the sources under DIR.
option_defined() {
  local name=$1 dir=$2 field
  field=${name//-/_}
  if grep -rqE "(long|alias|aliases)[[:space:]]*=[[:space:]]*\"$name\"|\"--$name\"" "$dir" \
      --include='*.rs'; then
    return 0
  fi
  # A field named after the option, under an attribute that says `long` without a name.
  find "$dir" -name '*.rs' -print0 | xargs -0 cat | awk -v f="$field" '
    /^[ \t]*\/\/\// { next }
    inattr || /^[ \t]*#\[(arg|clap)\(/ {
      attr = attr " " $0
      inattr = ($0 !~ /\)\][ \t]*$/)
      next
    }
    $0 ~ "^[ \t]*(pub[ \t]+)?" f "[ \t]*:" {
      if (attr ~ /[(, \t]long[ \t]*[,)]/) found = 1
    }
    /^[ \t]*(pub[ \t]+)?[a-z_][a-z0-9_]*[ \t]*:/ { attr = "" }
    /^[ \t]*}/ { attr = "" }
    END { exit found ? 0 : 1 }'
}

# Prints what a block asks of the workspace, one request a line:
#   BIN name | PKG name | OPT binary --option
# from its commands (comments removed, continuation lines joined).
block_requests() {
  awk '
    /^[ \t]*#/ { next }
    {
      line = $0
      sub(/[ \t]#[ \t].*$/, "", line)
      if (line ~ /\\$/) { held = held substr(line, 1, length(line) - 1) " "; next }
      line = held line; held = ""
      n = split(line, t, /[ \t]+/)
      cur = ""; pend = ""; cargo = 0; crun = 0; prev = ""; prevbin = 0
      for (i = 1; i <= n; i++) {
        w = t[i]
        if (w == "") continue
        sep = 0
        if (w == "|" || w == "||" || w == "&&" || w == ";" || w == "&") { sep = 1; w = "" }
        else if (w ~ /;$/) { sep = 1; sub(/;+$/, "", w) }
        c = w
        sub(/^["'"'"'(]*(\$\()?/, "", c); sub(/[)"'"'"';]*$/, "", c)
        if (w == "") {
        } else if (cargo && (prev == "-p" || prev == "--package")) {
          print "PKG " c
          if (crun) pend = "pkg:" c
        } else if (cargo && prev == "--bin") {
          print "BIN " c
          if (crun) pend = c
        } else if (w == "cargo") {
          cargo = 1; crun = 0; cur = ""; pend = ""
        } else if (cargo && w == "run" && !crun && prev == "cargo") {
          crun = 1
        } else if (w == "--") {
          if (crun && pend != "") { cur = pend; pend = ""; cargo = 0; crun = 0 }
          else { cur = ""; cargo = 0; crun = 0 }
        } else if (w !~ /=/ && c ~ /^([^ ]*\/)?psnet-[a-z0-9][a-z0-9-]*$/ && prev != "-p" && prev != "--bin") {
          b = c; sub(/^.*\//, "", b)
          print "BIN " b
          cur = b; prevbin = 1; prev = w; continue
        } else if (w ~ /^--[A-Za-z0-9][A-Za-z0-9_-]*(=.*)?$/ && cur != "") {
          o = w; sub(/=.*$/, "", o)
          print "OPT " cur " " o
        } else if (cur == "psnet-launch" && w !~ /^-/ && prev !~ /^-/ && !prevbin) {
          cur = ""    # the command psnet-launch starts: its options are not psnet-launch'"'"'s
        }
        prevbin = 0
        prev = w
        if (sep) { cur = ""; pend = ""; cargo = 0; crun = 0; prev = "" }
      }
    }'
}

# Checks one block's requests; prints the problems, one a line.
check_requests() {
  local kind name opt dir pkg
  while read -r kind name opt; do
    case $kind in
      PKG)
        awk -v p="$name" '$1 == p { f = 1 } END { exit !f }' "$WORK/pkgs" ||
          echo "no package $name in the workspace" ;;
      BIN)
        [ -n "$(bin_dir "$name")" ] || echo "no binary $name in the workspace" ;;
      OPT)
        case $name in
          pkg:*)
            # cargo run -p PACKAGE: its one binary.
            pkg=${name#pkg:}
            dir=$(awk -v p="$pkg" '$1 == p { print $2; exit }' "$WORK/pkgs")
            [ -n "$dir" ] || continue
            if [ "$(awk -v d="$dir" '$2 == d' "$WORK/bins" | wc -l)" -ne 1 ]; then
              echo "cargo run -p $pkg: name the binary (--bin), the package has not exactly one"
              continue
            fi
            name=$(awk -v d="$dir" '$2 == d { print $1; exit }' "$WORK/bins") ;;
        esac
        dir=$(bin_dir "$name")
        [ -n "$dir" ] || continue
        option_defined "${opt#--}" "$dir/src" || echo "$name has no option $opt (in $dir/src)" ;;
    esac
  done
}

# --- The blocks ------------------------------------------------------------------------------
# $WORK/blocks/N.sh: a block's text; $WORK/blocks/N.at: "FILE:LINE".
mkdir -p "$WORK/blocks"
for f in "${DOCS[@]}"; do
  awk -v file="$f" -v out="$WORK/blocks" '
    BEGIN { n = 0; while ((getline l < (out "/count")) > 0) n = l; close(out "/count") }
    /^[ \t]*```/ {
      if (!infence) {
        infence = 1
        lang = $0; sub(/^[ \t]*```[ \t]*/, "", lang); sub(/[ \t,{].*$/, "", lang)
        sh = (lang == "sh" || lang == "bash" || lang == "shell")
        if (sh) { n++; print file ":" NR > (out "/" n ".at"); printf "" > (out "/" n ".sh") }
      } else { infence = 0; if (sh) { close(out "/" n ".sh"); close(out "/" n ".at") } sh = 0 }
      next
    }
    infence && sh { l = $0; sub(/^[ \t]+/, "", l); print l > (out "/" n ".sh") }
    END { print n > (out "/count") }' "$f"
done
nblocks=$(cat "$WORK/blocks/count" 2>/dev/null || echo 0)

n_run=0 n_parse=0 n_ci=0
for ((i = 1; i <= nblocks; i++)); do
  at=$(cat "$WORK/blocks/$i.at")
  block="$WORK/blocks/$i.sh"
  marker=$(awk 'NF { print; exit }' "$block")
  case $marker in
    "# check: ci") n_ci=$((n_ci + 1)); echo "skip ci    $at"; continue ;;
    "# check: run") kind=run ;;
    "# check: parse") kind=parse ;;
    *) fail "$at: a sh block without a '# check: run|parse|ci' first line"; continue ;;
  esac
  problems=$(block_requests < "$block" | check_requests)
  if [ -n "$problems" ]; then
    while IFS= read -r p; do fail "$at: $p"; done <<< "$problems"
    continue
  fi
  if [ "$kind" = parse ]; then
    n_parse=$((n_parse + 1)); echo "ok   parse  $at"; continue
  fi
  n_run=$((n_run + 1))
  if [ "$RUN_BLOCKS" = 0 ]; then echo "ok   parse  $at (run block; --no-run)"; continue; fi
  left=$((TOTAL_TIMEOUT - (SECONDS - START)))
  if [ "$left" -le 0 ]; then fail "$at: not run, CHECK_DOCS_TIMEOUT (${TOTAL_TIMEOUT} s) spent"; continue; fi
  limit=$((left < BLOCK_TIMEOUT ? left : BLOCK_TIMEOUT))
  t0=$SECONDS
  if timeout --kill-after=10 "$limit" bash -euo pipefail "$block" > "$WORK/log" 2>&1; then
    echo "ok   run    $at ($((SECONDS - t0)) s)"
  else
    rc=$?
    fail "$at: exited $rc after $((SECONDS - t0)) s (limit $limit s); its last lines:"
    tail -n 20 "$WORK/log" | sed 's/^/       /'
  fi
done

# --- The links -------------------------------------------------------------------------------
# Headings of a Markdown file as GitHub's anchors: lower case, punctuation dropped, spaces to
# dashes, "-1", "-2" for repeats.
slugs() {
  awk '/^[ \t]*```/ { f = !f; next } !f && /^#+[ \t]/ { sub(/^#+[ \t]+/, ""); sub(/[ \t]+#*[ \t]*$/, ""); print }' "$1" |
    LC_ALL=C.UTF-8 sed -E 's/.*/\L&/; s/[^[:alnum:] _-]//g; s/ /-/g' |
    awk '{ s = $0; if (seen[s]++) s = s "-" (seen[$0] - 1); print s }'
}

n_links=0
for f in "${DOCS[@]}"; do
  base=$(dirname "$f")
  bad=0 count=0
  while IFS= read -r target; do
    count=$((count + 1))
    case $target in http://* | https://* | mailto:*) continue ;; esac
    path=${target%%#*}
    frag=
    if [[ $target == *"#"* ]]; then frag=${target#*#}; fi
    if [ -z "$path" ]; then dest=$f; else dest="$base/$path"; fi
    if [ ! -e "$dest" ]; then fail "$f: link to $target: no such file ($dest)"; bad=1; continue; fi
    if [ -n "$frag" ]; then
      case $dest in
        *.md)
          if ! grep -qxF -- "$frag" <<< "$(slugs "$dest")"; then
            fail "$f: link to $target: no heading #$frag in $dest"; bad=1
          fi ;;
      esac
    fi
  done < <(awk '/^[ \t]*```/ { f = !f; next }
    !f {
      s = $0
      while (match(s, /\]\([^) \t]+\)/)) {
        print substr(s, RSTART + 2, RLENGTH - 3)
        s = substr(s, RSTART + RLENGTH)
      }
    }' "$f")
  n_links=$((n_links + count))
  if [ "$bad" = 0 ]; then echo "ok   links  $f ($count)"; fi
done

echo "check-docs: $nblocks sh blocks ($n_run run$([ "$RUN_BLOCKS" = 0 ] && echo ", not run"), $n_parse parse, $n_ci ci), $n_links links in ${#DOCS[@]} files, $((SECONDS - START)) s: $([ "$failures" = 0 ] && echo "all good" || echo "$failures failures")"
[ "$failures" = 0 ]
