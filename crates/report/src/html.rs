//! `allocsim report`: one self-contained HTML page (inline SVG, no scripts, no network) with the
//! timeline of allocated / active / reserved memory against the allowed maximum and OOM markers,
//! fragmentation over time, and the segment map at the peak and at the first OOM (blocks coloured
//! by state; hovering shows size, request and call site). Several configs are overlaid.

use std::fmt::Write;

use allocsim_model::format::{format_size as fs, oom_message};
use allocsim_model::{AllocatorConfig, Placement};
use allocsim_replay::{Prepared, ReplayOutcome};

use crate::explain::{op_index_of_malloc, state_before};
use crate::series::{FragSeries, Series, record};

/// One config's run in the report.
pub struct Run {
    pub label: String,
    pub config: AllocatorConfig,
    pub outcome: ReplayOutcome,
    pub series: Series,
    pub frag: FragSeries,
}

pub struct Report {
    pub title: String,
    pub capacity: Option<u64>,
    pub requests: u32,
    pub runs: Vec<Run>,
    /// (title, svg) segment maps.
    pub maps: Vec<(String, String)>,
    pub oom_messages: Vec<(String, String)>,
}

const COLORS: [&str; 6] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf"];
const W: f64 = 960.0;
const H: f64 = 300.0;
const ML: f64 = 70.0;
const MB: f64 = 30.0;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// A "nice" tick step for a byte axis.
fn byte_step(max: u64) -> u64 {
    let target = (max / 5).max(1);
    let mut step = 1u64 << 20;
    while step < target {
        step *= 2;
    }
    step
}

/// Builds the report for `configs` (label, settings) replayed over `prepared`.
pub fn build(prepared: &Prepared, title: &str, configs: &[(String, AllocatorConfig)], capacity: Option<u64>, placement: &Placement) -> Report {
    let mut runs = Vec::new();
    for (label, config) in configs {
        let (outcome, series, frag) = record(prepared, config, capacity, placement, 1500);
        runs.push(Run { label: label.clone(), config: config.clone(), outcome, series, frag });
    }
    let mut maps = Vec::new();
    let mut oom_messages = Vec::new();
    if let Some(first) = runs.first() {
        // The segment map at the peak of the first config, and at its first OOM.
        let peak_req = peak_request(&first.outcome);
        if let Some(k) = op_index_of_malloc(&prepared.program, peak_req) {
            maps.push((
                format!("Segments after request {peak_req}, at peak reserved ({}) — {}", fs(first.outcome.peak_reserved), first.label),
                segment_map(prepared, &first.config, capacity, placement, k + 1),
            ));
        }
        if let Some(o) = first.outcome.first_oom()
            && let Some(k) = op_index_of_malloc(&prepared.program, o) {
                maps.push((format!("Segments when request {o} ran out of memory — {}", first.label), segment_map(prepared, &first.config, capacity, placement, k)));
            }
    }
    for run in &runs {
        if let Some(o) = run.outcome.ooms.first() {
            let r = &prepared.program.requests[o.request as usize];
            let mut info = o.info.clone();
            let own = prepared.is_own(&run.config, capacity);
            let simulated_outside = !prepared.limits(capacity).outside.is_empty();
            info.device_free = allocsim_replay::oom::device_free_estimate(&prepared.trace, r, &o.info, own, prepared.device_memory, simulated_outside);
            oom_messages.push((run.label.clone(), oom_message(&info, prepared.device as i32, "")));
        }
    }
    // The allowed maximum drawn: the one given, else the trace's own (inferred).
    let capacity = capacity.or(prepared.budget.capacity());
    Report { title: title.to_string(), capacity, requests: prepared.program.requests.len() as u32, runs, maps, oom_messages }
}

fn peak_request(o: &ReplayOutcome) -> u32 {
    let (mut cur, mut best, mut at) = (0i64, -1i64, 0u32);
    for e in &o.segment_events {
        cur += if matches!(e.action, "segment_alloc" | "segment_map") { e.size as i64 } else { -(e.size as i64) };
        if cur > best {
            best = cur;
            at = e.request;
        }
    }
    at
}

/// The timeline: reserved (solid), allocated (dashed) per run; the allowed maximum; OOM markers.
pub fn timeline_svg(r: &Report) -> String {
    let n = r.requests.max(1) as f64;
    let ymax = r
        .runs
        .iter()
        .flat_map(|run| run.series.reserved.iter().copied())
        .chain(r.capacity)
        .max()
        .unwrap_or(1)
        .max(1) as f64
        * 1.08;
    let x = |req: u32| ML + (req as f64 / n) * (W - ML - 10.0);
    let y = |b: u64| H - MB - (b as f64 / ymax) * (H - MB - 10.0);
    let mut s = String::new();
    let _ = write!(s, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="11" role="img" aria-label="memory timeline">"#);
    axes(&mut s, ymax as u64, r.requests, &x, &y);
    if let Some(c) = r.capacity {
        let _ = write!(s, r##"<line x1="{ML}" x2="{0}" y1="{1}" y2="{1}" stroke="#c00" stroke-dasharray="6 3"/><text x="{2}" y="{3}" fill="#c00">allowed {4}</text>"##, W - 10.0, y(c), W - 170.0, y(c) - 4.0, fs(c));
    }
    for (i, run) in r.runs.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts = |v: &[u64]| run.series.request.iter().zip(v).map(|(&q, &b)| format!("{:.1},{:.1}", x(q), y(b))).collect::<Vec<_>>().join(" ");
        let _ = write!(s, r#"<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{}"><title>reserved — {}</title></polyline>"#, pts(&run.series.reserved), esc(&run.label));
        let _ = write!(s, r#"<polyline fill="none" stroke="{color}" stroke-width="1" stroke-dasharray="4 2" opacity="0.8" points="{}"><title>allocated — {}</title></polyline>"#, pts(&run.series.allocated), esc(&run.label));
        for (j, o) in run.outcome.ooms.iter().enumerate().take(200) {
            let px = x(o.request);
            let _ = write!(
                s,
                r##"<g class="oom-marker" id="oom-marker-{i}-{j}"><line x1="{px:.1}" x2="{px:.1}" y1="10" y2="{}" stroke="#c00" stroke-width="0.8" opacity="0.6"/><path d="M{:.1},10 l-5,-8 h10 z" fill="#c00"/><title>OOM at request {} ({}): {} — {}</title></g>"##,
                H - MB,
                px,
                o.request,
                fs(o.info.rounded_size),
                esc(&run.label),
                fs(o.info.alloc_size)
            );
        }
    }
    s.push_str("</svg>");
    s
}

fn axes(s: &mut String, ymax: u64, n: u32, x: &dyn Fn(u32) -> f64, y: &dyn Fn(u64) -> f64) {
    let _ = write!(s, r##"<line x1="{ML}" x2="{ML}" y1="8" y2="{0}" stroke="#444"/><line x1="{ML}" x2="{1}" y1="{0}" y2="{0}" stroke="#444"/>"##, H - MB, W - 10.0);
    let step = byte_step(ymax);
    let mut t = 0u64;
    while t <= ymax {
        let _ = write!(s, r##"<line x1="{ML}" x2="{0}" y1="{1:.1}" y2="{1:.1}" stroke="#eee"/><text x="{2}" y="{3:.1}" text-anchor="end" fill="#333">{4}</text>"##, W - 10.0, y(t), ML - 4.0, y(t) + 4.0, fs(t));
        t += step;
    }
    let xs = (n / 8).max(1);
    let mut q = 0;
    while q <= n {
        let _ = write!(s, r##"<text x="{:.1}" y="{}" text-anchor="middle" fill="#333">{q}</text>"##, x(q), H - MB + 14.0);
        q += xs;
    }
    let _ = write!(s, r##"<text x="{}" y="{}" text-anchor="middle" fill="#333">request</text>"##, ML + (W - ML) / 2.0, H - 2.0);
}

/// Fragmentation over time: reserved − allocated, and largest free block / total free.
pub fn frag_svg(r: &Report) -> String {
    let n = r.requests.max(1) as f64;
    let ymax = r.runs.iter().flat_map(|run| run.frag.unallocated.iter().copied()).max().unwrap_or(1).max(1) as f64 * 1.1;
    let x = |req: u32| ML + (req as f64 / n) * (W - ML - 10.0);
    let y = |b: u64| H - MB - (b as f64 / ymax) * (H - MB - 10.0);
    let yr = |f: f64| H - MB - f * (H - MB - 10.0);
    let mut s = String::new();
    let _ = write!(s, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="11" role="img" aria-label="fragmentation">"#);
    axes(&mut s, ymax as u64, r.requests, &x, &y);
    for (i, run) in r.runs.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<String> = run.frag.request.iter().zip(&run.frag.unallocated).map(|(&q, &b)| format!("{:.1},{:.1}", x(q), y(b))).collect();
        let _ = write!(s, r#"<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{}"><title>reserved − allocated — {}</title></polyline>"#, pts.join(" "), esc(&run.label));
        let pts: Vec<String> = run.frag.request.iter().zip(&run.frag.largest_free_ratio).map(|(&q, &f)| format!("{:.1},{:.1}", x(q), yr(f))).collect();
        let _ = write!(s, r#"<polyline fill="none" stroke="{color}" stroke-width="1" stroke-dasharray="2 2" points="{}"><title>largest free block ÷ total free (0–1, right scale) — {}</title></polyline>"#, pts.join(" "), esc(&run.label));
    }
    let _ = write!(s, r##"<text x="{}" y="18" text-anchor="end" fill="#333">dotted: largest free block ÷ total free (top = 1)</text></svg>"##, W - 12.0);
    s
}

/// The segments just before op `k`: one row per segment, blocks coloured by state; hover for details.
fn segment_map(prepared: &Prepared, config: &AllocatorConfig, capacity: Option<u64>, placement: &Placement, k: usize) -> String {
    let st = state_before(prepared, config, capacity, placement, k);
    let a = &st.allocator;
    let by_ptr: std::collections::HashMap<u64, u32> = st.live.iter().map(|(&q, &p)| (p, q)).collect();
    let mut segs = a.segments();
    segs.sort_by(|x, y| y.total_size.cmp(&x.total_size).then(x.address.cmp(&y.address)));
    let shown = segs.len().min(300);
    let max = segs.iter().map(|s| s.total_size).max().unwrap_or(1) as f64;
    let row = 9.0;
    let h = 20.0 + row * shown as f64 + 20.0;
    let mut s = String::new();
    let _ = write!(s, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" viewBox="0 0 {W} {h}" font-family="sans-serif" font-size="10" role="img" aria-label="segment map">"#);
    let width = W - 200.0;
    for (i, seg) in segs.iter().take(shown).enumerate() {
        let y0 = 14.0 + i as f64 * row;
        let _ = write!(s, r##"<text x="4" y="{:.1}" fill="#333">{:#x} {}</text>"##, y0 + 7.0, seg.address, fs(seg.total_size));
        let mut off = 0u64;
        for &b in &seg.blocks {
            let blk = a.block(b);
            let (color, state) = if blk.allocated {
                ("#1f77b4", "allocated")
            } else if blk.event_count > 0 {
                ("#ff7f0e", "waiting for a cross-stream free")
            } else {
                ("#ddd", "free")
            };
            let x0 = 190.0 + off as f64 / max * width;
            let w = (blk.size as f64 / max * width).max(0.5);
            let who = by_ptr.get(&blk.ptr).map(|&q| {
                let site = prepared.call_site(q).map(|c| format!(" at {c}")).unwrap_or_default();
                format!(", request {q}{site}{}", stack_lines(prepared.frames(q)))
            });
            let _ = write!(
                s,
                r##"<rect x="{x0:.2}" y="{y0:.1}" width="{w:.2}" height="{:.1}" fill="{color}" stroke="#fff" stroke-width="0.3"><title>{} {state}{} (segment {:#x}, {}{})</title></rect>"##,
                row - 1.5,
                fs(blk.size),
                esc(&who.unwrap_or_default()),
                seg.address,
                if seg.is_small { "small pool" } else { "large pool" },
                if seg.is_expandable { ", expandable" } else { "" }
            );
            off += blk.size;
        }
    }
    if segs.len() > shown {
        let _ = write!(s, r##"<text x="4" y="{:.1}" fill="#333">… {} smaller segments not drawn</text>"##, h - 6.0, segs.len() - shown);
    }
    s.push_str("</svg>");
    s
}

/// A stack for a tooltip: its Python frames, one per line (C++ frames counted).
fn stack_lines(frames: &[allocsim_trace::Frame]) -> String {
    const MAX: usize = 12;
    let python: Vec<_> = allocsim_trace::frames::python_frames(frames).collect();
    let mut s = String::new();
    for f in python.iter().take(MAX) {
        s.push_str("\n    ");
        s.push_str(&allocsim_trace::frames::frame_text(f));
    }
    if python.len() > MAX {
        let _ = write!(s, "\n    … {} more Python frames", python.len() - MAX);
    }
    let native = frames.len() - python.len();
    if native > 0 && !python.is_empty() {
        let _ = write!(s, "\n    ({native} C++ frames)");
    }
    s
}

/// The whole page.
pub fn render(r: &Report) -> String {
    let mut h = String::new();
    let _ = write!(
        h,
        r#"<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>allocsim report — {}</title><style>
body{{font-family:sans-serif;margin:24px;color:#222;max-width:1000px}} h1{{font-size:20px}} h2{{font-size:16px;margin-top:28px}}
table{{border-collapse:collapse;font-size:13px}} td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}} th{{background:#f4f4f4}} td:first-child,th:first-child{{text-align:left}}
.msg{{font-family:monospace;font-size:12px;background:#fff4f4;border-left:3px solid #c00;padding:6px 10px;white-space:pre-wrap}} .key span{{display:inline-block;width:18px;height:3px;vertical-align:middle;margin:0 4px 0 12px}}
</style></head><body><h1>allocsim report — {}</h1><p>{} requests{}. Replayed through a model of PyTorch 2.11's CUDA caching allocator.</p>"#,
        esc(&r.title),
        esc(&r.title),
        r.requests,
        r.capacity.map_or(String::new(), |c| format!(", allowed maximum {}", fs(c)))
    );
    h.push_str("<table><tr><th>config</th><th>peak reserved</th><th>peak allocated</th><th>utilization</th><th>OOMs</th><th>first OOM</th><th>cudaMalloc/map</th><th>cudaFree/unmap</th></tr>");
    for run in &r.runs {
        let st = &run.outcome.stats;
        let peak_active = st.active_bytes.all().peak as f64;
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.1}%</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&run.label),
            fs(run.outcome.peak_reserved),
            fs(st.allocated_bytes.all().peak as u64),
            100.0 * peak_active / (run.outcome.peak_reserved.max(1) as f64),
            run.outcome.ooms.len(),
            run.outcome.first_oom().map_or("none".into(), |x| format!("request {x}")),
            st.num_device_alloc,
            st.num_device_free
        );
    }
    h.push_str("</table><p style=\"font-size:12px\">utilization = peak active ÷ peak reserved (the GMLake/STAlloc figure).</p>");
    h.push_str("<h2>Memory over the run</h2><p class=\"key\">");
    for (i, run) in r.runs.iter().enumerate() {
        let _ = write!(h, "<span style=\"background:{}\"></span>{}", COLORS[i % COLORS.len()], esc(&run.label));
    }
    h.push_str(" — solid: reserved, dashed: allocated; red triangles: OOMs; red dashed line: the allowed maximum. Each point is the maximum of its bucket of requests.</p>");
    h.push_str(&timeline_svg(r));
    for (label, m) in &r.oom_messages {
        let _ = write!(h, "<p><b>{}</b> — first OOM, as PyTorch reports it (without NVML's per-process sentence):</p><div class=\"msg\" id=\"oom-message\">{}</div>", esc(label), esc(m));
    }
    h.push_str("<h2>Fragmentation over the run</h2><p>Solid: reserved − allocated. Dotted: largest free block ÷ total free memory (1 = all free memory in one block).</p>");
    h.push_str(&frag_svg(r));
    for (title, svg) in &r.maps {
        let _ = write!(h, "<h2>{}</h2><p><span style=\"color:#1f77b4\">■</span> allocated <span style=\"color:#ff7f0e\">■</span> waiting for a cross-stream free <span style=\"color:#bbb\">■</span> free. Largest segments first, bars to scale; hover a block for its size, request and call site.</p>", esc(title));
        h.push_str(svg);
    }
    h.push_str("</body></html>\n");
    h
}
