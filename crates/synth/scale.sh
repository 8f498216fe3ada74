#!/usr/bin/env bash
# Scaling figures for docs/performance.md ("Scale") and docs/scaling.svg.
#   crates/synth/scale.sh [OUTDIR] [REQUEST COUNTS...]
# For each count: `allocsim synth --workload training --no-frames` to JSON Lines (streamed), then
# `/usr/bin/time -v allocsim replay` on it (release build; the replay streams the file). Writes OUTDIR/cli.csv and, with
# `examples/scale.rs`, OUTDIR/memory.csv (generated in memory and replayed, up to 50 M requests),
# OUTDIR/live.csv (replay time against live blocks) and docs/scaling.svg.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-/tmp/allocsim-scale}
shift || true
counts=${*:-10000 100000 1000000 10000000 20000000 50000000}
mkdir -p "$out"
cargo build --release --quiet
cargo build --release --quiet -p allocsim-synth --example scale
bin=target/release/allocsim
echo "requests,entries,file_bytes,gen_s,replay_s,peak_rss_kb" > "$out/cli.csv"
for n in $counts; do
  # `replay` streams JSON Lines in memory bounded by the live set: any length fits (the file
  # needs about 333 bytes a request of disk).
  f="$out/training-$n.jsonl"
  /usr/bin/time -f "%e %M" -o "$out/gen.time" "$bin" synth --workload training --requests "$n" --seed 1 --no-frames -o "$f" 2> "$out/gen.log"
  entries=$(grep -o '[0-9]* trace entries' "$out/gen.log" | cut -d' ' -f1)
  /usr/bin/time -v -o "$out/replay-$n.time" "$bin" replay "$f" > "$out/replay-$n.txt"
  wall=$(awk -F': ' '/Elapsed \(wall clock\)/{print $2}' "$out/replay-$n.time" | awk -F: '{ if (NF==3) print $1*3600+$2*60+$3; else print $1*60+$2 }')
  rss=$(awk -F': ' '/Maximum resident set size/{print $2}' "$out/replay-$n.time")
  echo "$n,$entries,$(stat -c %s "$f"),$(cut -d' ' -f1 "$out/gen.time"),$wall,$rss" | tee -a "$out/cli.csv"
  rm -f "$f"
done
# In memory (no file): up to 50 M requests when the memory is there (about 250 bytes a request).
echo "requests,entries,gen_s,build_s,replay_s,requests_per_s,peak_reserved,peak_rss_kb" > "$out/memory.csv"
avail_kb=$(awk '/MemAvailable/{print $2}' /proc/meminfo)
for n in 10000 100000 1000000 10000000 20000000 50000000; do
  if [ $((n * 3 / 10)) -gt "$avail_kb" ]; then echo "skipping $n requests in memory: ${avail_kb} kB available"; continue; fi
  target/release/examples/scale length "$n" | tee -a "$out/memory.csv"
done
target/release/examples/scale live 4000000 16,64,256,1024,4096,16384,65536,262144,1048576 | tee "$out/live.csv"
target/release/examples/scale plot "$out/cli.csv" "$out/memory.csv" "$out/live.csv" > docs/scaling.svg
