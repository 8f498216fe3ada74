//! `sweep`: every config of a grid, ranked (logic: `allocsim_whatif::sweep`).

use std::io::{self, Write};

use allocsim_model::format::format_size;
use allocsim_replay::Prepared;
use allocsim_whatif::grid::{DEFAULT_GRID, GridPoint, parse_grid, parse_grid_with};
use allocsim_whatif::sweep::{Row, replay_count};
use comfy_table::{Table, presets};
use serde_json::{Value, json};

use crate::{Answer, Error, Trace, TraceOptions};

/// `sweep`'s question.
#[derive(Clone, Debug)]
pub struct SweepOptions {
    pub trace: TraceOptions,
    /// The allowed maximum to sweep under; default: the trace's own budget (inferred from it),
    /// else the whole device.
    pub capacity: Option<u64>,
    /// `key=v1,v2; key2=...` (`none` leaves a key out); default: [`DEFAULT_GRID`].
    pub grid: Option<String>,
    /// Settings put before every grid point (e.g. `large_segment_size_mb:64`).
    pub base: String,
    /// Segment placements per config (expandable-segment configs need one).
    pub placements: usize,
    /// How many rows the text shows (configs with the same outcome share one).
    pub top: usize,
    /// The widest the text's table may be, in columns (`None`: as wide as it needs).
    pub width: Option<u16>,
}

/// The table's width when nothing says otherwise (a terminal's `COLUMNS` or `--wide` do).
pub const DEFAULT_WIDTH: u16 = 100;

impl Default for SweepOptions {
    fn default() -> Self {
        SweepOptions { trace: TraceOptions::default(), capacity: None, grid: None, base: String::new(), placements: 4, top: 15, width: Some(DEFAULT_WIDTH) }
    }
}

/// The settings of a config string, key by key (a `roundup_power2_divisions` list's commas stay
/// inside its brackets).
fn settings_of(conf: &str) -> Vec<(String, String)> {
    let (mut out, mut depth, mut start) = (Vec::new(), 0i32, 0usize);
    let b = conf.as_bytes();
    for i in 0..=b.len() {
        let c = b.get(i).copied();
        match c {
            Some(b'[') => depth += 1,
            Some(b']') => depth -= 1,
            Some(b',') | None if depth <= 0 => {
                let item = conf[start..i].trim();
                if !item.is_empty() {
                    let (k, v) = item.split_once(':').unwrap_or((item, ""));
                    out.push((k.trim().to_string(), v.trim().to_string()));
                }
                start = i + 1;
            }
            _ => {}
        }
    }
    out
}

/// Rows whose outcomes are the same (every placement's OOMs, peaks, retries, syncs and device
/// calls), best first as the rows are: each group's configs, first the one shown.
pub fn same_outcome_groups(rows: &[Row]) -> Vec<Vec<&Row>> {
    let key = |r: &Row| {
        r.outcomes
            .iter()
            .map(|o| {
                (o.first_oom, o.ooms, o.peak_reserved, o.peak_allocated, o.num_alloc_retries, o.num_sync_all_streams, o.num_device_alloc, o.num_device_free)
            })
            .collect::<Vec<_>>()
    };
    let mut groups: Vec<(Vec<_>, Vec<&Row>)> = Vec::new();
    for r in rows.iter().filter(|r| r.rejected.is_none()) {
        let k = key(r);
        match groups.iter_mut().find(|(g, _)| *g == k) {
            Some((_, v)) => v.push(r),
            None => groups.push((k, vec![r])),
        }
    }
    groups.into_iter().map(|(_, v)| v).collect()
}

/// What the configs of a group share, in words: "N more alike: any K1, K2" where the keys named
/// take several values in the group (or are set in some and not in others).
fn alike_words(group: &[&Row]) -> Option<String> {
    if group.len() < 2 {
        return None;
    }
    let sets: Vec<Vec<(String, String)>> = group.iter().map(|r| settings_of(&r.conf)).collect();
    let mut keys: Vec<String> = sets.iter().flatten().map(|(k, _)| k.clone()).collect();
    keys.sort();
    keys.dedup();
    let varying: Vec<String> = keys
        .into_iter()
        .filter(|k| {
            let vals: Vec<Option<&String>> = sets.iter().map(|s| s.iter().find(|(kk, _)| kk == k).map(|(_, v)| v)).collect();
            vals.iter().any(|v| *v != vals[0])
        })
        .collect();
    Some(format!("+{} alike{}", group.len() - 1, varying.iter().map(|k| format!("\nany {k}")).collect::<String>()))
}

/// The grid points of these options (PyTorch's rules reject invalid ones as rows, not here),
/// parsed as PyTorch 2.11 parses them: before a trace is read (the count of replays, a grid's
/// syntax). [`sweep`] replays them as the trace's release parses them.
pub fn grid_points(a: &SweepOptions) -> Result<Vec<GridPoint>, Error> {
    parse_grid(a.grid.as_deref().unwrap_or(DEFAULT_GRID), &a.base).map_err(Error::Usage)
}

/// A grid's points with each settings string parsed as the trace's release parses it
/// (`Prepared::parse_config`, as every `--config` is).
pub fn grid_points_for(grid: &str, base: &str, p: &Prepared) -> Result<Vec<GridPoint>, Error> {
    let version = p.rules.version;
    parse_grid_with(grid, base, |conf| version.parse_config(conf).map_err(|e| e.to_string())).map_err(Error::Usage)
}

/// How many replays [`sweep`] makes at most (for a progress bar).
pub fn replays(a: &SweepOptions, points: &[GridPoint]) -> usize {
    replay_count(points, a.placements)
}

/// `sweep`; `progress` is called once per finished replay.
pub fn sweep(t: Trace<'_>, a: &SweepOptions, progress: &(dyn Fn() + Sync)) -> Result<SweepAnswer, Error> {
    let p = a.trace.prepare(t.snapshot)?;
    crate::input::no_requests(t, &p, "replay under other settings")?;
    let points = grid_points_for(a.grid.as_deref().unwrap_or(DEFAULT_GRID), &a.base, &p)?;
    let t0 = std::time::Instant::now();
    let limits = p.limits(a.capacity);
    let rows = allocsim_whatif::sweep::sweep(&p, &points, &limits, a.placements, progress);
    // An allowed maximum known as an interval: the outcomes at its two ends say which answers
    // depend on where in it the real one lies.
    let ends = match (a.capacity, p.budget.allowed_low, p.budget.allowed_high) {
        (None, Some(lo), Some(hi)) if p.budget.allowed_is_interval() => Some((lo, hi)),
        _ => None,
    };
    let depends: Vec<String> = match ends {
        Some((lo, hi)) => {
            let at = |c: u64| allocsim_whatif::sweep::sweep(&p, &points, &p.limits_at(c), a.placements, &|| {});
            allocsim_whatif::sweep::depends_on_limits(&[&rows, &at(lo), &at(hi)])
        }
        None => Vec::new(),
    };
    let secs = t0.elapsed().as_secs_f64();
    // Which iteration each outcome's reserved memory peaks in (when the trace has iterations).
    let layout = allocsim_phases::Layout::of(&p, None).ok().filter(|l| l.iterations.len() > 1);
    let not_reproduced = p.not_reproduced();
    Ok(SweepAnswer { name: t.name.to_owned(), options: a.clone(), prepared: p, points, rows, secs, ends, depends, layout, not_reproduced })
}

/// What `sweep` found.
pub struct SweepAnswer {
    pub name: String,
    pub options: SweepOptions,
    pub prepared: Prepared,
    pub points: Vec<GridPoint>,
    /// Best first, rejected configs last.
    pub rows: Vec<Row>,
    pub secs: f64,
    /// The ends of an inferred allowed maximum, when it is an interval.
    pub ends: Option<(u64, u64)>,
    /// The configs whose outcome differs between those ends.
    pub depends: Vec<String>,
    layout: Option<allocsim_phases::Layout>,
    /// The trace's own replay is not the recording.
    pub not_reproduced: Option<allocsim_replay::settings_change::NotReproduced>,
}

impl SweepAnswer {
    /// The iteration holding a request (when the trace has iterations).
    fn iteration_of(&self, q: Option<u32>) -> Option<usize> {
        self.layout.as_ref().and_then(|l| l.iteration_of_request(q?))
    }

    /// `sweep --csv`.
    pub fn write_csv(&self, out: &mut dyn Write) -> io::Result<()> {
        write_sweep_csv(out, &self.rows)
    }
}

impl Answer for SweepAnswer {
    fn write_text(&self, out: &mut dyn Write) -> io::Result<()> {
        write_sweep_text(out, self)
    }
    fn to_json(&self) -> Value {
        let (a, rows, p) = (&self.options, &self.rows, &self.prepared);
        let mut rows_json = serde_json::to_value(rows).expect("JSON");
        for (r, row) in rows.iter().zip(rows_json.as_array_mut().expect("rows")) {
            for (o, out) in r.outcomes.iter().zip(row["outcomes"].as_array_mut().expect("outcomes")) {
                out["peak_reserved_iteration"] = json!(self.iteration_of(o.peak_reserved_request));
            }
        }
        let mut out = json!({
            "trace": self.name,
            "capacity": a.capacity,
            "grid": a.grid.as_deref().unwrap_or(DEFAULT_GRID),
            "placements": a.placements,
            "seconds": self.secs,
            "iterations": self.layout.as_ref().map(|l| l.iterations.len()),
            "rows": rows_json,
            "could_swap_with_next": allocsim_whatif::sweep::placement_sensitive_pairs(rows),
            "allowed_maximum_used": p.limits(a.capacity).capacity,
            "budget": p.budget.to_json(),
            "depends_on_allowed_maximum": self.depends,
        });
        crate::input::add_not_reproduced_json(&mut out, self.not_reproduced.as_ref());
        out
    }
}

fn oom_cell(p: &Prepared, row: &Row) -> String {
    let n = row.outcomes.len();
    let k = row.placements_with_oom();
    if k == 0 {
        return "no".into();
    }
    let (lo, _) = row.first_oom_range();
    let lo = lo.unwrap_or(0);
    let req = &p.program.requests[lo as usize];
    let mut s = format!("request {lo} ({})", format_size(req.size));
    if n > 1 {
        s.push_str(&format!("\nfirst, in {k}/{n} placements"));
    }
    let _ = p;
    s
}

fn range(r: Option<(u64, u64)>) -> String {
    match r {
        Some((lo, hi)) if format_size(lo) == format_size(hi) => format_size(lo),
        Some((lo, hi)) => {
            let (l, h) = (format_size(lo), format_size(hi));
            // "5.54–5.56 GiB" where both have one unit.
            match (l.rsplit_once(' '), h.rsplit_once(' ')) {
                (Some((lv, lu)), Some((hv, hu))) if lu == hu => format!("{lv}–{hv} {hu}"),
                _ => format!("{l}–{h}"),
            }
        }
        None => "-".into(),
    }
}

/// `sweep --csv`: one row per config, best first.
fn write_sweep_csv(out: &mut dyn Write, rows: &[Row]) -> io::Result<()> {
    writeln!(
        out,
        "rank,config,rejected,placements,placements_with_oom,first_oom_min,first_oom_max,peak_reserved_min,peak_reserved_max,peak_allocated,retries,syncs,device_alloc,device_free,device_call_ms"
    )?;
    for (i, r) in rows.iter().enumerate() {
        let w = r.worst();
        let (lo, hi) = r.first_oom_range();
        let (pl, ph) = r.peak_reserved_range().unwrap_or((0, 0));
        writeln!(
            out,
            "{},\"{}\",\"{}\",{},{},{},{},{},{},{},{},{},{},{},{:.3}",
            i + 1,
            r.conf,
            r.rejected.clone().unwrap_or_default().replace('"', "'"),
            r.outcomes.len(),
            r.placements_with_oom(),
            lo.map_or(String::new(), |x| x.to_string()),
            hi.map_or(String::new(), |x| x.to_string()),
            pl,
            ph,
            w.map_or(0, |w| w.peak_allocated),
            w.map_or(0, |w| w.num_alloc_retries),
            w.map_or(0, |w| w.num_sync_all_streams),
            w.map_or(0, |w| w.num_device_alloc),
            w.map_or(0, |w| w.num_device_free),
            w.map_or(0.0, |w| w.device_call_us / 1000.0)
        )?;
    }
    Ok(())
}

/// `sweep` as text: the table of the `top` best configs, whether outcomes depend on where in an
/// inferred allowed maximum the real one lies, the rejected configs, the recommendation.
fn write_sweep_text(out: &mut dyn Write, s: &SweepAnswer) -> io::Result<()> {
    let a = &s.options;
    let (p, points, rows, secs) = (&s.prepared, &s.points[..], &s.rows[..], s.secs);
    let interval = s.ends.map(|e| (e, s.depends.as_slice()));
    let iteration_of = |q: Option<u32>| s.iteration_of(q);
    let limits = p.limits(a.capacity);
    let valid = rows.iter().filter(|r| r.rejected.is_none()).count();
    let shared = rows.iter().flat_map(|r| &r.outcomes).filter(|o| o.same_as.is_some()).count();
    let width = a.width;
    let head = format!(
        "{}: {} requests, {} configs ({} placements each, expandable segments once), {} outcomes under {} ({} replayed; {} shared with a config that cannot behave differently on this trace); {:.1} s",
        s.name,
        p.program.requests.len(),
        valid,
        a.placements,
        replay_count(points, a.placements),
        match (a.capacity, limits.capacity, limits.outside.is_empty()) {
            (Some(c), _, _) => format!("a {} cap", format_size(c)),
            (None, Some(c), _) => format!("the trace's own allowed maximum, {} (inferred)", format_size(c)),
            (None, None, false) => "the trace's own budget (a full device, inferred)".to_string(),
            (None, None, true) => "no cap".to_string(),
        },
        replay_count(points, a.placements) - shared,
        shared,
        secs
    );
    crate::write_wrapped(out, &head, width, 2)?;
    crate::input::write_not_reproduced(out, s.not_reproduced.as_ref(), false)?;
    let mut t = Table::new();
    t.load_style(presets::UTF8_FULL_CONDENSED);
    if let Some(w) = a.width {
        t.set_content_arrangement(comfy_table::ContentArrangement::Dynamic);
        t.set_width(w);
    }
    let with_iterations = rows.iter().flat_map(|r| &r.outcomes).any(|o| iteration_of(o.peak_reserved_request).is_some());
    let mut header = vec!["#", "config", "OOM", "peak reserved"];
    if with_iterations {
        header.push("iteration");
    }
    header.extend(["unallocated at peak", "retries / syncs", "device calls"]);
    t.set_header(header);
    let groups = same_outcome_groups(rows);
    let group_of = |conf: &str| groups.iter().position(|g| g.iter().any(|r| r.conf == conf));
    for (i, g) in groups.iter().take(a.top).enumerate() {
        let r = g[0];
        let w = r.worst().unwrap();
        // The iterations where the placements' peaks fall (one, usually).
        let mut its: Vec<usize> = r.outcomes.iter().filter_map(|o| iteration_of(o.peak_reserved_request)).collect();
        its.sort_unstable();
        its.dedup();
        let mut cells = vec![
            (i + 1).to_string(),
            format!(
                "{}{}",
                if r.conf.is_empty() {
                    "(defaults)".to_string()
                } else {
                    settings_of(&r.conf).iter().map(|(k, v)| format!("{k}:{v}")).collect::<Vec<_>>().join("\n")
                },
                alike_words(g).map_or(String::new(), |w| format!("\n{w}"))
            ),
            oom_cell(p, r),
            range(r.peak_reserved_range()),
        ];
        if with_iterations {
            cells.push(its.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", "));
        }
        cells.extend([
            format_size(w.peak_reserved.saturating_sub(w.peak_allocated)),
            format!("{} / {}", w.num_alloc_retries, w.num_sync_all_streams),
            format!("{} / {}\n{:.1} ms", w.num_device_alloc, w.num_device_free, (w.device_call_us / 1000.0).max(0.0)),
        ]);
        t.add_row(cells);
    }
    if a.width.is_some()
        && let Some(c) = t.column_mut(1)
    {
        // The settings, one a line, keep their names whole.
        c.set_constraint(comfy_table::ColumnConstraint::LowerBoundary(comfy_table::Width::Fixed(34)));
    }
    if a.width.is_some()
        && let Some(c) = t.column_mut(2)
    {
        c.set_constraint(comfy_table::ColumnConstraint::LowerBoundary(comfy_table::Width::Fixed(20)));
    }
    writeln!(out, "{t}")?;
    if groups.len() > a.top {
        writeln!(out, "({} more outcomes not shown; --json has every config)", groups.len() - a.top)?;
    }
    // Where the first OOMs shown come from (call sites are too long for a cell).
    let mut firsts: Vec<u32> = groups.iter().take(a.top).filter_map(|g| g[0].first_oom_range().0).collect();
    firsts.sort_unstable();
    firsts.dedup();
    for q in firsts {
        let size = format_size(p.program.requests[q as usize].size);
        let site = p.call_site(q).map_or_else(|| "(no stack recorded)".to_string(), |s| format!("at {s}"));
        crate::write_wrapped(out, &format!("OOM at request {q} ({size}) {site}"), width, 2)?;
    }
    if a.capacity.is_none() {
        for line in crate::budget_lines(&p.budget) {
            crate::write_wrapped(out, &format!("budget: {line}"), width, 2)?;
        }
    }
    match interval {
        Some(((lo, hi), [])) => crate::write_wrapped(
            out,
            &format!("every outcome above is the same at both ends of the inferred allowed maximum ({}–{})", format_size(lo), format_size(hi)),
            width,
            2,
        )?,
        Some(((lo, hi), depends)) => {
            let mut shown: Vec<usize> = depends.iter().filter_map(|c| group_of(c)).collect();
            shown.sort_unstable();
            shown.dedup();
            crate::write_wrapped(
                out,
                &format!(
                    "depends on where in {}–{} the real allowed maximum lies (the outcome differs between its ends): {}",
                    format_size(lo),
                    format_size(hi),
                    shown.iter().map(|i| format!("#{}", i + 1)).collect::<Vec<_>>().join(", ")
                ),
                width,
                2,
            )?
        }
        None => {}
    }
    for r in rows.iter().filter(|r| r.rejected.is_some()) {
        crate::write_wrapped(out, &format!("rejected by PyTorch: {} — {}", r.conf, r.rejected.as_ref().unwrap()), width, 2)?;
    }
    if limits.capacity.is_none() && points.iter().any(|p| p.config.as_ref().is_ok_and(|c| c.gc_enabled())) {
        crate::write_wrapped(out, "note: garbage_collection_threshold has no effect without a memory fraction (give --capacity)", width, 2)?;
    }
    // Rankings that placement can flip: adjacent configs whose outcome ranges overlap.
    let flips = allocsim_whatif::sweep::placement_sensitive_pairs(rows);
    let flips: Vec<String> = flips
        .iter()
        .filter_map(|&i| Some((group_of(&rows[i].conf)?, group_of(&rows[i + 1].conf)?)))
        .filter(|(x, y)| x != y && *y < a.top)
        .map(|(x, y)| format!("#{} and #{}", x + 1, y + 1))
        .collect();
    if !flips.is_empty() {
        crate::write_wrapped(
            out,
            &format!("placement: these neighbours could swap places depending on where the driver puts segments (their ranges overlap): {}", flips.join(", ")),
            width,
            2,
        )?;
    }
    let own = rows.iter().position(|r| r.rejected.is_none() && p.parse_config(&r.conf).is_ok_and(|c| p.is_own_under(&c, &limits)));
    let name = |r: &Row| if r.conf.is_empty() { "the defaults".to_string() } else { r.conf.clone() };
    let own_name = |r: &Row| format!("{} (the trace's own settings)", name(r));
    use allocsim_whatif::sweep::Recommendation as R;
    let line = match allocsim_whatif::sweep::recommend(rows, own) {
        None => return Ok(()),
        Some(R::KeepOwn { own }) => format!("recommendation: keep {} — they rank first", own_name(&rows[own])),
        Some(R::OwnAsGood { own, best }) => format!(
            "recommendation: keep {} — they are as good as any setting tried (no OOM avoided or postponed, and peak reserved {} against {} at best, {}: less than {:.0}% apart)",
            own_name(&rows[own]),
            range(rows[own].peak_reserved_range()),
            range(rows[best].peak_reserved_range()),
            name(&rows[best]),
            100.0 * allocsim_whatif::sweep::MIN_GAIN
        ),
        Some(R::Better { best, own }) if rows[own].placements_with_oom() > 0 && rows[best].placements_with_oom() == 0 => format!(
            "recommendation: {} avoids the OOM at request {} under {} (peak reserved {})",
            name(&rows[best]),
            rows[own].first_oom_range().0.unwrap_or(0),
            own_name(&rows[own]),
            range(rows[best].peak_reserved_range())
        ),
        Some(R::Better { best, own }) => format!(
            "recommendation: {} (peak reserved {} vs {} under {}{})",
            name(&rows[best]),
            range(rows[best].peak_reserved_range()),
            range(rows[own].peak_reserved_range()),
            own_name(&rows[own]),
            match (rows[best].first_oom_range().0, rows[own].first_oom_range().0) {
                (Some(b), Some(o)) if b > o => format!("; its first OOM comes at request {b} instead of {o}"),
                _ => String::new(),
            }
        ),
        Some(R::Best { best }) => format!("recommendation: {} (peak reserved {})", name(&rows[best]), range(rows[best].peak_reserved_range())),
        Some(R::AllOom { smallest, shortfall, request }) => format!(
            "recommendation: none — every setting runs out of memory; the smallest shortfall is {} ({}, at request {request}); `allocsim fit` finds the allowed maximum each setting needs",
            format_size(shortfall),
            name(&rows[smallest])
        ),
    };
    crate::write_wrapped(out, &line, width, 2)?;
    Ok(())
}
