//! `allocsim report`: one self-contained HTML page (inline SVG, no scripts, no network) with the
//! timeline of allocated / active / reserved memory against the allowed maximum and OOM markers,
//! fragmentation over time, and the segment map at the peak and at the first OOM (blocks coloured
//! by state; hovering shows size, request and call site). Several configs are overlaid. When the
//! trace has iterations (`allocsim_phases`), the timeline shows them as alternating bands with the
//! annotated regions as a strip along its foot, and a chart gives each iteration's peaks (under the
//! first config), the one that first reached the run's peak marked.

use std::fmt::Write;

use allocsim_model::format::{format_size as fs, oom_message};
use allocsim_model::{AllocatorConfig, Placement};
use allocsim_phases::{Layout, Phases, Source};
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
    /// The iterations and regions, measured under the first config (`None`: the trace has neither
    /// more than one iteration nor any region).
    pub phases: Option<Phases>,
    /// `explain`'s verdict on the first config's OOM that ended the run (empty: no OOM).
    pub verdict: Vec<String>,
    /// The PyTorch release whose rules the replays follow.
    pub torch_version: String,
    /// The trace's own replay is not the recording (`Prepared::not_reproduced`).
    pub not_reproduced: Option<allocsim_replay::settings_change::NotReproduced>,
}

/// A free block in the segment maps.
const FREE_COLOR: &str = "#ccc";
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
        let peak_req = prepared.peak_request(&first.outcome, &first.config, &prepared.limits(capacity), placement.clone()).unwrap_or(0);
        if let Some(k) = op_index_of_malloc(&prepared.program, peak_req) {
            maps.push((
                format!("Segments after request {peak_req}, at peak reserved ({}) — {}", fs(first.outcome.peak_reserved), first.label),
                segment_map(prepared, &first.config, capacity, placement, k + 1),
            ));
        }
        if let Some(o) = first.outcome.first_oom()
            && let Some(k) = op_index_of_malloc(&prepared.program, o)
        {
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
    // The iterations under the first config, replayed as its run was.
    let phases = runs.first().and_then(|first| {
        let layout = Layout::of(prepared, None).ok()?;
        (layout.iterations.len() > 1 || !layout.regions.is_empty()).then(|| allocsim_phases::measure(prepared, &layout, &first.config, capacity, placement, 0))
    });
    // `explain`'s verdict, for the first config as `explain --config` would give it.
    let verdict = runs
        .first()
        .filter(|first| !first.outcome.ooms.is_empty())
        .and_then(|first| {
            let x = crate::explain::explain(prepared, &first.config, capacity, placement, crate::explain::At::EndingOom, crate::explain::CANDIDATES)?;
            let causes = crate::explain::oom_causes(prepared, &first.outcome);
            let own = prepared.is_own(&first.config, capacity);
            Some(crate::explain::verdict_lines(&x, &causes, own, false, &first.config, capacity, prepared))
        })
        .unwrap_or_default();
    // The allowed maximum drawn: the one given, else the trace's own (inferred).
    let capacity = capacity.or(prepared.budget.capacity());
    Report {
        title: title.to_string(),
        capacity,
        requests: prepared.program.requests.len() as u32,
        runs,
        maps,
        oom_messages,
        phases,
        verdict,
        torch_version: prepared.rules.version.to_string(),
        not_reproduced: prepared.not_reproduced(),
    }
}

/// A colour per region name, in order of first appearance.
fn region_colors(ph: &Phases) -> Vec<(&str, &'static str)> {
    const PALETTE: [&str; 8] = ["#8dd3c7", "#fdb462", "#bebada", "#fb8072", "#80b1d3", "#b3de69", "#fccde5", "#bc80bd"];
    let mut v: Vec<(&str, &'static str)> = Vec::new();
    for r in &ph.regions {
        if !v.iter().any(|(n, _)| *n == r.name) {
            v.push((&r.name, PALETTE[v.len() % PALETTE.len()]));
        }
    }
    v
}

/// Iteration bands behind the timeline and the outermost regions as a strip along its foot.
fn phase_bands(s: &mut String, ph: &Phases, x: &dyn Fn(u32) -> f64) {
    const MAX_BANDS: usize = 2000;
    let labels = ph.iterations.len() <= 60;
    for it in ph.iterations.iter().take(MAX_BANDS) {
        let (Some(a), Some(b)) = (it.peaks.first_request, it.peaks.last_request) else { continue };
        let (x0, x1) = (x(a), x(b + 1));
        let fill = if it.index % 2 == 0 { "#f3f3f3" } else { "#fafafa" };
        let _ = write!(
            s,
            r##"<g class="iteration-band"><rect x="{x0:.1}" y="8" width="{:.1}" height="{:.1}" fill="{fill}"{}/><title>iteration {}: requests {a}–{b}, peak allocated {}, peak reserved {}</title></g>"##,
            (x1 - x0).max(0.5),
            H - MB - 8.0,
            if it.global_peak { r##" stroke="#888" stroke-dasharray="2 2""## } else { "" },
            it.index,
            fs(it.peaks.peak_allocated),
            fs(it.peaks.peak_reserved)
        );
        if labels {
            let _ = write!(s, r##"<text x="{:.1}" y="19" text-anchor="middle" fill="#777" font-size="11">{}</text>"##, (x0 + x1) / 2.0, it.index);
        }
    }
    let colors = region_colors(ph);
    for r in ph.regions.iter().filter(|r| r.depth == 0).take(MAX_BANDS) {
        let (Some(a), Some(b)) = (r.peaks.first_request, r.peaks.last_request) else { continue };
        let color = colors.iter().find(|(n, _)| *n == r.name).map_or("#ccc", |c| c.1);
        let _ = write!(
            s,
            r##"<g class="region-band"><rect x="{:.1}" y="{:.1}" width="{:.1}" height="6" fill="{color}"/><title>{}{}: peak allocated {}</title></g>"##,
            x(a),
            H - MB - 7.0,
            (x(b + 1) - x(a)).max(0.5),
            esc(&r.name),
            r.iteration.map_or(String::new(), |i| format!(" (iteration {i})")),
            fs(r.peaks.peak_allocated)
        );
    }
}

/// Each iteration's peak allocated (bar) and peak reserved (tick), the first to reach the run's
/// peak in a darker colour.
pub fn iterations_svg(ph: &Phases) -> String {
    let n = ph.iterations.len().max(1);
    let ymax = ph.iterations.iter().map(|i| i.peaks.peak_reserved.max(i.peaks.peak_allocated)).max().unwrap_or(1).max(1) as f64 * 1.08;
    let bw = (W - ML - 10.0) / n as f64;
    let x = |i: usize| ML + i as f64 * bw;
    let y = |b: u64| H - MB - (b as f64 / ymax) * (H - MB - 10.0);
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" id="iteration-peaks" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="11" role="img" aria-label="peak memory per iteration">"#
    );
    let _ =
        write!(s, r##"<line x1="{ML}" x2="{ML}" y1="8" y2="{0}" stroke="#444"/><line x1="{ML}" x2="{1}" y1="{0}" y2="{0}" stroke="#444"/>"##, H - MB, W - 10.0);
    let step = byte_step(ymax as u64);
    let mut t = 0u64;
    while (t as f64) <= ymax {
        let _ = write!(
            s,
            r##"<line x1="{ML}" x2="{0}" y1="{1:.1}" y2="{1:.1}" stroke="#eee"/><text x="{2}" y="{3:.1}" text-anchor="end" fill="#333">{4}</text>"##,
            W - 10.0,
            y(t),
            ML - 4.0,
            y(t) + 4.0,
            fs(t)
        );
        t += step;
    }
    let every = n.div_ceil(30);
    for it in &ph.iterations {
        let (x0, w) = (x(it.index) + bw * 0.15, bw * 0.7);
        let color = if it.global_peak { "#08519c" } else { "#6baed6" };
        let _ = write!(
            s,
            r##"<g class="iteration-bar{class}"><rect x="{x0:.1}" y="{ya:.1}" width="{w:.1}" height="{ha:.1}" fill="{color}"/><line x1="{x0:.1}" x2="{x1:.1}" y1="{yr:.1}" y2="{yr:.1}" stroke="#d62728" stroke-width="2"/><title>iteration {i}{partial}: peak allocated {pa}, peak reserved {pr}{ooms}</title></g>"##,
            class = if it.global_peak { " peak" } else { "" },
            ya = y(it.peaks.peak_allocated),
            ha = (H - MB) - y(it.peaks.peak_allocated),
            yr = y(it.peaks.peak_reserved),
            x1 = x0 + w,
            i = it.index,
            partial = if it.complete { "" } else { " (partial)" },
            pa = fs(it.peaks.peak_allocated),
            pr = fs(it.peaks.peak_reserved),
            ooms = if it.peaks.ooms > 0 { format!(", {} OOM{}", it.peaks.ooms, if it.peaks.ooms == 1 { "" } else { "s" }) } else { String::new() }
        );
        if it.index % every == 0 {
            let _ = write!(s, r##"<text x="{:.1}" y="{}" text-anchor="middle" fill="#333">{}</text>"##, x(it.index) + bw / 2.0, H - MB + 14.0, it.index);
        }
    }
    let _ = write!(s, r##"<text x="{}" y="{}" text-anchor="middle" fill="#333">iteration</text></svg>"##, ML + (W - ML) / 2.0, H - 2.0);
    s
}

/// The timeline: reserved (solid), allocated (dashed) per run; the allowed maximum; OOM markers.
pub fn timeline_svg(r: &Report) -> String {
    let n = r.requests.max(1) as f64;
    let ymax = r.runs.iter().flat_map(|run| run.series.reserved.iter().copied()).chain(r.capacity).max().unwrap_or(1).max(1) as f64 * 1.08;
    let x = |req: u32| ML + (req as f64 / n) * (W - ML - 10.0);
    let y = |b: u64| H - MB - (b as f64 / ymax) * (H - MB - 10.0);
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="11" role="img" aria-label="memory timeline">"#
    );
    if let Some(ph) = &r.phases {
        phase_bands(&mut s, ph, &x);
    }
    axes(&mut s, ymax as u64, r.requests, &x, &y);
    if let Some(c) = r.capacity {
        let _ = write!(
            s,
            r##"<line x1="{ML}" x2="{0}" y1="{1}" y2="{1}" stroke="#c00" stroke-dasharray="6 3"/><text x="{2}" y="{3}" fill="#c00">allowed {4}</text>"##,
            W - 10.0,
            y(c),
            W - 170.0,
            y(c) - 4.0,
            fs(c)
        );
    }
    for (i, run) in r.runs.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts = |v: &[u64]| run.series.request.iter().zip(v).map(|(&q, &b)| format!("{:.1},{:.1}", x(q), y(b))).collect::<Vec<_>>().join(" ");
        let _ = write!(
            s,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{}"><title>reserved — {}</title></polyline>"#,
            pts(&run.series.reserved),
            esc(&run.label)
        );
        let _ = write!(
            s,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1" stroke-dasharray="4 2" opacity="0.8" points="{}"><title>allocated — {}</title></polyline>"#,
            pts(&run.series.allocated),
            esc(&run.label)
        );
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
    let _ =
        write!(s, r##"<line x1="{ML}" x2="{ML}" y1="8" y2="{0}" stroke="#444"/><line x1="{ML}" x2="{1}" y1="{0}" y2="{0}" stroke="#444"/>"##, H - MB, W - 10.0);
    let step = byte_step(ymax);
    let mut t = 0u64;
    while t <= ymax {
        let _ = write!(
            s,
            r##"<line x1="{ML}" x2="{0}" y1="{1:.1}" y2="{1:.1}" stroke="#eee"/><text x="{2}" y="{3:.1}" text-anchor="end" fill="#333">{4}</text>"##,
            W - 10.0,
            y(t),
            ML - 4.0,
            y(t) + 4.0,
            fs(t)
        );
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
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="11" role="img" aria-label="fragmentation">"#
    );
    axes(&mut s, ymax as u64, r.requests, &x, &y);
    for (i, run) in r.runs.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<String> = run.frag.request.iter().zip(&run.frag.unallocated).map(|(&q, &b)| format!("{:.1},{:.1}", x(q), y(b))).collect();
        let _ = write!(
            s,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{}"><title>reserved − allocated — {}</title></polyline>"#,
            pts.join(" "),
            esc(&run.label)
        );
        let pts: Vec<String> = run.frag.request.iter().zip(&run.frag.largest_free_ratio).map(|(&q, &f)| format!("{:.1},{:.1}", x(q), yr(f))).collect();
        let _ = write!(
            s,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1" stroke-dasharray="2 2" points="{}"><title>largest free block ÷ total free (0–1, right scale) — {}</title></polyline>"#,
            pts.join(" "),
            esc(&run.label)
        );
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
    let row = 15.0;
    let h = 20.0 + row * shown as f64 + 20.0;
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" viewBox="0 0 {W} {h}" font-family="sans-serif" font-size="12" role="img" aria-label="segment map">"#
    );
    let width = W - 200.0;
    for (i, seg) in segs.iter().take(shown).enumerate() {
        let y0 = 14.0 + i as f64 * row;
        let _ = write!(s, r##"<text x="4" y="{:.1}" fill="#333">{:#x} {}</text>"##, y0 + 11.0, seg.address, fs(seg.total_size));
        let mut off = 0u64;
        for &b in &seg.blocks {
            let blk = a.block(b);
            let (color, state) = if blk.allocated {
                ("#1f77b4", "allocated")
            } else if blk.event_count > 0 {
                ("#ff7f0e", "waiting for a cross-stream free")
            } else {
                (FREE_COLOR, "free")
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
                if seg.is_expandable { ", expandable" } else { "" },
            );
            if seg.pool_id != (0, 0) {
                // The tooltip ends with the segment's private pool.
                if let Some(at) = s.rfind(")</title>") {
                    s.insert_str(at, &format!(" of private pool {:?}", seg.pool_id));
                }
            }
            off += blk.size;
        }
    }
    if segs.len() > shown {
        let _ = write!(s, r##"<text x="4" y="{:.1}" fill="#333">… {} smaller segments not drawn</text>"##, h - 6.0, segs.len() - shown);
    }
    s.push_str("</svg>");
    let f = crate::frag::breakdown(a);
    if !f.private_pools.is_empty() {
        s.push_str("<table class=\"pools\"><tr><th>private pool</th><th>reserved</th><th>share of reserved</th><th>allocated</th><th>free</th><th>segments</th><th>serving requests</th></tr>");
        for p in &f.private_pools {
            let _ = write!(
                s,
                "<tr><td>{:?}</td><td>{}</td><td>{:.1}%</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                p.pool_id,
                fs(p.reserved),
                100.0 * p.share_of_reserved,
                fs(p.allocated),
                fs(p.free),
                p.segments,
                if p.freeable { "no: its users are gone, its live blocks hold it" } else { "yes" }
            );
        }
        s.push_str("</table>");
    }
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
.msg{{font-family:monospace;font-size:13px;background:#fff4f4;border-left:3px solid #c00;padding:6px 10px;white-space:pre-wrap}}
.verdict{{font-size:15px;background:#fff8e6;border-left:4px solid #c60;padding:8px 12px;margin:12px 0}} .verdict p{{margin:4px 0}} .key span{{display:inline-block;width:18px;height:3px;vertical-align:middle;margin:0 4px 0 12px}}
</style></head><body><h1>allocsim report — {}</h1><p>{} requests{}. Replayed through a model of PyTorch {}'s CUDA caching allocator.</p>"#,
        esc(&r.title),
        esc(&r.title),
        r.requests,
        r.capacity.map_or(String::new(), |c| format!(", allowed maximum {}", fs(c))),
        esc(&r.torch_version)
    );
    if let Some(n) = &r.not_reproduced {
        use allocsim_replay::settings_change::NotReproduced;
        let _ = write!(h, "<div class=\"verdict\" id=\"not-reproduced\"><p>Not reproduced: {}.</p>", esc(NotReproduced::SUMMARY));
        if !n.settings_changed.is_empty() {
            let _ = write!(h, "<p>Settings changed {}:</p><ul>", esc(NotReproduced::SETTINGS_CHANGED));
            for why in &n.settings_changed {
                let _ = write!(h, "<li>{}</li>", esc(why));
            }
            h.push_str("</ul>");
        }
        h.push_str("</div>");
    }
    if !r.verdict.is_empty() {
        h.push_str("<div class=\"verdict\" id=\"verdict\">");
        for line in &r.verdict {
            let _ = write!(h, "<p>{}</p>", esc(line));
        }
        h.push_str("</div>");
    }
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
    h.push_str(" — solid: reserved, dashed: allocated");
    if r.runs.iter().any(|run| !run.outcome.ooms.is_empty()) {
        h.push_str("; red triangles: OOMs");
    }
    if r.capacity.is_some() {
        h.push_str("; red dashed line: the allowed maximum");
    }
    h.push_str(". Each point is the maximum of its bucket of requests.</p>");
    if let Some(ph) = &r.phases {
        h.push_str("<p class=\"key\">");
        if ph.iterations.len() > 1 {
            let _ = write!(h, "Grey bands: iterations ({}).", esc(&source_words(&ph.source)));
        }
        for (name, color) in region_colors(ph) {
            let _ = write!(h, "<span style=\"background:{color};height:6px\"></span>{}", esc(name));
        }
        h.push_str(" (regions, outermost, along the foot).</p>");
    }
    h.push_str(&timeline_svg(r));
    if let Some(ph) = &r.phases {
        let peak = ph.peak_iteration.map_or(String::new(), |i| {
            let it = &ph.iterations[i];
            format!(" Iteration {i} first reached the run's peak allocated, {} (dark bar).", fs(it.peaks.peak_allocated))
        });
        let _ = write!(
            h,
            "<h2>Peak memory per iteration</h2><p>Bars: peak allocated; red ticks: peak reserved ({}), as <code>reset_peak_memory_stats()</code> at each iteration's start and <code>max_memory_allocated()</code> at its end would read them.{peak}</p>",
            esc(&r.runs.first().map_or(String::new(), |run| run.label.clone()))
        );
        h.push_str(&iterations_svg(ph));
    }
    for (label, m) in &r.oom_messages {
        let _ = write!(
            h,
            "<p><b>{}</b> — first OOM, as PyTorch reports it (without NVML's per-process sentence):</p><div class=\"msg\" id=\"oom-message\">{}</div>",
            esc(label),
            esc(m)
        );
    }
    h.push_str("<h2>Fragmentation over the run</h2><p>Solid: reserved − allocated. Dotted: largest free block ÷ total free memory (1 = all free memory in one block).</p>");
    h.push_str(&frag_svg(r));
    for (title, svg) in &r.maps {
        let pending =
            if svg.contains("waiting for a cross-stream free") { "<span style=\"color:#ff7f0e\">■</span> waiting for a cross-stream free " } else { "" };
        let _ = write!(
            h,
            "<h2>{}</h2><p><span style=\"color:#1f77b4\">■</span> allocated {pending}<span style=\"color:{FREE_COLOR}\">■</span> free. Largest segments first, bars to scale; hover a block for its size, request and call site.</p>",
            esc(title)
        );
        h.push_str(svg);
    }
    h.push_str("</body></html>\n");
    h
}

fn source_words(s: &Source) -> String {
    match s {
        Source::Annotation { names } => format!("each ends with `{}`", names.join("`/`")),
        Source::Pattern { repeats, .. } => format!("{repeats} repetitions of the request pattern"),
        Source::Whole { .. } => "one: the whole trace".to_string(),
    }
}
