#!/usr/bin/env bash
# Snapshot pickles: `allocsim replay` (streamed, and --in-memory) against CPython's pickle.load of
# the same file, in the same run, and peak RSS against file size (docs/performance.md, "Pickles").
#   benches/pickle_stream.sh [OUTDIR] [REQUEST COUNTS...]
# For each count: `allocsim synth --workload kvcache` (with Python stacks) to OUTDIR/kv-N.pickle,
# then, alternating, RUNS (default 3) runs each of `allocsim replay FILE`, `python3 -c
# pickle.load(FILE)` and `allocsim replay --in-memory FILE` under /usr/bin/time; the best wall
# and user times and the largest peak RSS of each go to OUTDIR/pickle.csv, and a plot of peak RSS
# against file size to OUTDIR/pickle-rss.svg. Other jobs on the machine inflate wall times: the
# best of several runs is the figure, and the user times say how much CPU each took.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/allocsim-pickle}
shift || true
counts=${*:-24000 240000 1000000 3000000}
runs=${RUNS:-3}
mkdir -p "$out"
cargo build --release --quiet
bin=target/release/allocsim
py='import pickle, sys, gzip
p = sys.argv[1]
f = gzip.open(p, "rb") if p.endswith(".gz") else open(p, "rb")
d = pickle.load(f)
print(sum(len(t) for t in d["device_traces"]))'
# time_of CMD...: "wall user rss_kb" of one run.
time_of() {
  /usr/bin/time -f "%e %U %M" -o "$out/t" "$@" > /dev/null
  cat "$out/t"
}
best() { sort -n -k1 | awk 'NR==1{w=$1} {if(u==""||$2<u)u=$2; if($3>m)m=$3} END{print w, u, m}'; }
echo "requests,entries,file_bytes,stream_wall_s,stream_user_s,stream_rss_kb,cpython_wall_s,cpython_user_s,cpython_rss_kb,inmem_wall_s,inmem_user_s,inmem_rss_kb,commit" > "$out/pickle.csv"
commit=$(git rev-parse --short HEAD)
for n in $counts; do
  f="$out/kv-$n.pickle"
  [ -f "$f" ] || "$bin" synth --workload kvcache --requests "$n" --seed 1 -o "$f" 2> "$out/gen.log"
  entries=$(python3 -c "import pickle; print(sum(len(t) for t in pickle.load(open('$f','rb'))['device_traces']))")
  : > "$out/s"; : > "$out/c"; : > "$out/m"
  for _ in $(seq "$runs"); do
    time_of "$bin" replay "$f" >> "$out/s"
    time_of python3 -c "$py" "$f" >> "$out/c"
    time_of "$bin" replay --in-memory "$f" >> "$out/m"
  done
  read -r sw su sr < <(best < "$out/s")
  read -r cw cu cr < <(best < "$out/c")
  read -r mw mu mr < <(best < "$out/m")
  echo "$n,$entries,$(stat -c %s "$f"),$sw,$su,$sr,$cw,$cu,$cr,$mw,$mu,$mr,$commit" | tee -a "$out/pickle.csv"
done
# The plot: peak RSS against file size, log-log, one line each.
python3 - "$out/pickle.csv" "$out/pickle-rss.svg" <<'EOF'
import csv, math, sys
rows = list(csv.DictReader(open(sys.argv[1])))
W, H, L, B = 640, 400, 70, 50
xs = [int(r["file_bytes"]) for r in rows]
series = [("allocsim replay (streamed)", "stream_rss_kb", "#1f77b4"), ("allocsim replay --in-memory", "inmem_rss_kb", "#ff7f0e"), ("CPython pickle.load", "cpython_rss_kb", "#2ca02c")]
ys = [int(r[k]) * 1024 for _, k, _ in series for r in rows]
x0, x1 = math.log10(min(xs)) - 0.1, math.log10(max(xs)) + 0.1
y0, y1 = math.log10(min(ys)) - 0.2, math.log10(max(ys)) + 0.2
px = lambda x: L + (math.log10(x) - x0) / (x1 - x0) * (W - L - 20)
py = lambda y: H - B - (math.log10(y) - y0) / (y1 - y0) * (H - B - 20)
o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">', f'<rect width="{W}" height="{H}" fill="white"/>']
o.append(f'<line x1="{L}" y1="{H-B}" x2="{W-20}" y2="{H-B}" stroke="black"/><line x1="{L}" y1="20" x2="{L}" y2="{H-B}" stroke="black"/>')
for e in range(int(math.floor(y0)), int(math.ceil(y1)) + 1):
    if y0 <= e <= y1:
        y = py(10 ** e)
        lab = ["1 B", "10 B", "100 B", "1 kB", "10 kB", "100 kB", "1 MB", "10 MB", "100 MB", "1 GB", "10 GB", "100 GB"][e]
        o.append(f'<line x1="{L}" y1="{y:.1f}" x2="{W-20}" y2="{y:.1f}" stroke="#ddd"/><text x="{L-6}" y="{y+4:.1f}" text-anchor="end">{lab}</text>')
for x in xs:
    o.append(f'<text x="{px(x):.1f}" y="{H-B+16}" text-anchor="middle">{x/1e6:.0f} MB</text>')
o.append(f'<text x="{(W+L)/2}" y="{H-10}" text-anchor="middle">pickle file size (kvcache snapshots with stacks)</text>')
o.append(f'<text x="16" y="{(H-B)/2}" transform="rotate(-90 16 {(H-B)/2})" text-anchor="middle">peak RSS</text>')
for i, (name, k, c) in enumerate(series):
    pts = " ".join(f"{px(int(r['file_bytes'])):.1f},{py(int(r[k]) * 1024):.1f}" for r in rows)
    o.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="2"/>')
    for r in rows:
        o.append(f'<circle cx="{px(int(r["file_bytes"])):.1f}" cy="{py(int(r[k]) * 1024):.1f}" r="3" fill="{c}"/>')
    o.append(f'<text x="{L+10}" y="{34 + 16*i}" fill="{c}">{name}</text>')
o.append("</svg>")
open(sys.argv[2], "w").write("\n".join(o))
EOF
echo "wrote $out/pickle.csv and $out/pickle-rss.svg"
