//! `report`: one self-contained HTML page, and its plots as SVG files (logic:
//! `allocsim_report::html`).

use std::path::Path;

use crate::{Error, Trace, TraceOptions};

/// `report`'s question.
#[derive(Clone, Debug, Default)]
pub struct ReportOptions {
    pub trace: TraceOptions,
    /// Settings to replay under, each overlaid (default: the trace's own).
    pub configs: Vec<String>,
    /// The allowed maximum.
    pub capacity: Option<u64>,
}

/// The page and its plots.
pub struct HtmlReport {
    pub page: String,
    /// `(file name, SVG)`: the timeline, fragmentation, iterations (when the trace has them) and
    /// segment maps.
    pub svgs: Vec<(String, String)>,
}

/// `report`: the page titled by the trace's file name.
pub fn report(t: Trace<'_>, a: &ReportOptions) -> Result<HtmlReport, Error> {
    use allocsim_report::html;
    // When the first config is the trace's own, the capacity is taken as the cap it was recorded under.
    let (p, first) = a.trace.prepare_for(t.snapshot, a.configs.first().map(String::as_str), a.capacity)?;
    let mut configs = Vec::new();
    for c in &a.configs {
        let label = if c.trim().is_empty() { "defaults".to_string() } else { c.clone() };
        configs.push((label, p.parse_config(c)?));
    }
    if configs.is_empty() {
        let label = if first.source.is_empty() { "defaults (the trace's own)".to_string() } else { format!("{} (the trace's own)", first.source) };
        configs.push((label, first));
    }
    let title = Path::new(t.name).file_name().map_or("trace".to_string(), |f| f.to_string_lossy().to_string());
    let report = html::build(&p, &title, &configs, a.capacity, &p.recorded_placement());
    let page = html::render(&report);
    let mut svgs = vec![("timeline.svg".to_string(), html::timeline_svg(&report)), ("fragmentation.svg".to_string(), html::frag_svg(&report))];
    if let Some(ph) = &report.phases {
        svgs.push(("iterations.svg".to_string(), html::iterations_svg(ph)));
    }
    for (i, (_, svg)) in report.maps.iter().enumerate() {
        svgs.push((format!("segments-{}.svg", if i == 0 { "peak" } else { "oom" }), svg.clone()));
    }
    Ok(HtmlReport { page, svgs })
}

impl HtmlReport {
    /// Writes the page to `path`.
    pub fn write_page(&self, path: &Path) -> Result<(), Error> {
        std::fs::write(path, &self.page).map_err(|e| Error::Io(format!("{}: {e}", path.display())))
    }

    /// Writes the plots into `dir` (created if needed).
    pub fn write_svgs(&self, dir: &Path) -> Result<(), Error> {
        std::fs::create_dir_all(dir).map_err(|e| Error::Io(format!("{}: {e}", dir.display())))?;
        for (name, svg) in &self.svgs {
            let path = dir.join(name);
            std::fs::write(&path, svg).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
        }
        Ok(())
    }
}
