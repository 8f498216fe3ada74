#!/usr/bin/env bash
# Snapshot files you already have (real ones: C++ frames, history turned on mid-run): `allocsim
# replay FILE`, CPython's `pickle.load` of the same file and `allocsim replay --in-memory FILE`
# (the general decoders), side by side in one run (docs/performance.md, "Pickles").
#   benches/pickle_file.sh FILE...        (FILE: .pickle or .pickle.gz)
# For each file, alternating, RUNS (default 3) runs of each under /usr/bin/time; prints the best
# wall time, the best user and system (CPU) times and the largest peak RSS of each, and the
# speed-ups over CPython (best wall against best wall, best CPU against best CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-3}
cargo build --release --quiet
bin=target/release/allocsim
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
py='import pickle, sys, gzip
p = sys.argv[1]
f = gzip.open(p, "rb") if p.endswith(".gz") else open(p, "rb")
pickle.load(f)'
# time_of CMD...: "wall user sys rss_kb" of one run.
time_of() {
  /usr/bin/time -f "%e %U %S %M" -o "$tmp/t" "$@" > /dev/null
  cat "$tmp/t"
}
# best < runs: "wall cpu rss_kb user sys" (best wall, best user+sys, largest RSS, and the user and
# system times of the run with the best user+sys).
best() { awk '{c=$2+$3; if(w==""||$1<w)w=$1; if(cp==""||c<cp){cp=c;u=$2;s=$3} if($4>m)m=$4} END{printf "%.2f %.2f %d %.2f %.2f\n", w, cp, m, u, s}'; }
echo "commit $(git rev-parse --short HEAD), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), $(python3 -c 'import sys; print("CPython", sys.version.split()[0])')"
printf "%-48s %-28s %-28s %-28s %s\n" file "allocsim replay" "CPython pickle.load" "replay --in-memory" "speed-up wall / CPU"
for f in "$@"; do
  : > "$tmp/a"; : > "$tmp/c"; : > "$tmp/m"
  for _ in $(seq "$runs"); do
    time_of "$bin" replay "$f" >> "$tmp/a"
    time_of python3 -c "$py" "$f" >> "$tmp/c"
    time_of "$bin" replay --in-memory "$f" >> "$tmp/m"
  done
  read -r aw ac ar au as < <(best < "$tmp/a")
  read -r cw cc cr cu cs < <(best < "$tmp/c")
  read -r mw mc mr mu ms < <(best < "$tmp/m")
  fmt() { printf "%s s / %s+%s s / %d MiB" "$1" "$2" "$3" "$(( $4 / 1024 ))"; }
  printf "%-48s %-28s %-28s %-28s %s\n" "$(basename "$f") ($(( $(stat -c %s "$f") / 1000000 )) MB)" "$(fmt "$aw" "$au" "$as" "$ar")" "$(fmt "$cw" "$cu" "$cs" "$cr")" "$(fmt "$mw" "$mu" "$ms" "$mr")" \
    "$(python3 -c "print(f'{$cw/max($aw,0.01):.1f}x / {$cc/max($ac,0.01):.1f}x')")"
done
