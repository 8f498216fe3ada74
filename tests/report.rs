//! The HTML report in a real headless Chromium (Debian's `chromium`, which `.ci/run` installs):
//! the page loads with no console errors and shows the OOM markers and message.

use std::path::{Path, PathBuf};
use std::process::Command;

use allocsim_model::AllocatorConfig;
use allocsim_replay::Prepared;
use allocsim_report::html;
use allocsim_trace::read_trace;

const H200: u64 = 150_109_880_320;

fn frag_report() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/frag__default__2048M.pickle.gz");
    let cap = 2u64 << 30;
    let p = Prepared::new(&read_trace(&path).unwrap(), None, H200, Some(cap)).unwrap();
    let configs = vec![
        ("defaults".to_string(), AllocatorConfig::default()),
        ("expandable_segments:True".to_string(), AllocatorConfig::parse("expandable_segments:True").unwrap()),
    ];
    html::render(&html::build(&p, "frag", &configs, Some(cap), &p.recorded_placement()))
}

#[test]
fn report_is_self_contained_and_marks_the_ooms() {
    let page = frag_report();
    assert!(page.starts_with("<!DOCTYPE html>"));
    // No network: nothing is loaded from anywhere.
    for bad in ["<script", "<link ", "src=\"http", "href=\"http", "url(", "@import", "<img "] {
        assert!(!page.contains(bad), "the page must be self-contained ({bad})");
    }
    // 3 OOMs in each of the two runs, each with a marker.
    assert_eq!(page.matches("class=\"oom-marker\"").count(), 6);
    assert!(page.contains("Tried to allocate 256.00 MiB"));
    assert!(page.contains("Segments when request 300 ran out of memory"));
    // Hovering a block names its request and call site.
    assert!(page.contains("at gpu/record.py:56 in w_frag"));
    // It opens with `explain`'s verdict on the same question (the defaults, 2 GiB allowed): the
    // OOM that ended the run, request 302.
    let verdict = page.split("<div class=\"verdict\" id=\"verdict\">").nth(1).expect("a verdict").split("</div>").next().unwrap();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/frag__default__2048M.pickle.gz");
    let snap = read_trace(&path).unwrap();
    let x = allocsim_commands::explain::explain(
        allocsim_commands::Trace { name: "frag", snapshot: &snap },
        None,
        &allocsim_commands::explain::ExplainOptions { capacity: Some(2 << 30), config: Some(String::new()), ..Default::default() },
    )
    .unwrap();
    let allocsim_commands::explain::ExplainAnswer::Explained(e) = x else { panic!("no explanation") };
    let lines = allocsim_commands::explain::verdict_lines(&e);
    assert!(lines[0].starts_with("Out of memory at request 302"), "{lines:?}");
    let shown: Vec<String> = verdict
        .split("<p>")
        .skip(1)
        .map(|p| p.trim_end_matches("</p>").replace("&gt;", ">").replace("&lt;", "<").replace("&quot;", "\"").replace("&amp;", "&"))
        .collect();
    assert_eq!(shown, lines);
}

/// The legend names only what is drawn: no OOM markers, allowed maximum or pending frees where
/// the replay has none.
#[test]
fn the_legend_names_what_is_drawn() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/unet512__default__0M.pickle.gz");
    let p = Prepared::new(&read_trace(&path).unwrap(), None, H200, None).unwrap();
    let page = html::render(&html::build(&p, "unet", &[("defaults".to_string(), AllocatorConfig::default())], None, &p.recorded_placement()));
    assert!(!page.contains("class=\"oom-marker\""));
    for absent in ["red triangles", "allowed maximum", "waiting for a cross-stream free", "class=\"verdict\""] {
        assert!(!page.contains(absent), "{absent}");
    }
    // Free blocks are drawn in the colour the legend shows.
    let legend_free = page.split("■</span> free").next().unwrap().rsplit("color:").next().unwrap().split('"').next().unwrap().to_string();
    assert!(page.contains(&format!("fill=\"{legend_free}\"")), "free blocks are not drawn in {legend_free}");
}

fn chromium() -> Option<PathBuf> {
    ["/usr/bin/chromium", "/usr/bin/chromium-browser"].iter().map(PathBuf::from).find(|p| p.exists())
}

#[test]
fn report_renders_in_headless_chromium() {
    let Some(chrome) = chromium() else {
        if std::env::var_os("ALLOCSIM_REQUIRE_CHROMIUM").is_some() {
            panic!("chromium is required (ALLOCSIM_REQUIRE_CHROMIUM is set) but not installed");
        }
        eprintln!("note: chromium not installed; skipping the browser test (.ci/run installs it)");
        return;
    };
    let dir = std::env::temp_dir().join(format!("allocsim-report-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let page = dir.join("frag.html");
    std::fs::write(&page, frag_report()).unwrap();
    let out = Command::new(chrome)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--enable-logging=stderr",
            "--v=0",
            &format!("--user-data-dir={}", dir.join("profile").display()),
            "--dump-dom",
            &format!("file://{}", page.display()),
        ])
        .output()
        .expect("run chromium");
    let dom = String::from_utf8_lossy(&out.stdout);
    let log = String::from_utf8_lossy(&out.stderr);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "chromium failed: {log}");
    // The DOM Chromium built holds the SVG timeline with the OOM markers and the message.
    assert!(dom.contains("oom-marker-0-0"), "no OOM marker in the rendered DOM");
    assert!(dom.contains("<svg"), "no SVG rendered");
    assert!(dom.contains("Tried to allocate 256.00 MiB"));
    let console_errors: Vec<&str> = log.lines().filter(|l| l.contains("CONSOLE") || l.contains("Uncaught")).collect();
    assert!(console_errors.is_empty(), "console errors: {console_errors:?}");
}

/// A recording its own replay does not reproduce (settings changed at run time, traces/field/
/// test_cuda) says so at the top of its page, with the facts `validate` names; one it
/// reproduces does not. The page names the release whose rules replayed it.
#[test]
fn report_says_when_the_replay_is_not_the_recording() {
    let page = |name: &str| {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(name);
        let snap = read_trace(&path).unwrap();
        let p = allocsim_replay::TraceOptions::default().prepare(&snap).unwrap();
        let configs = vec![("own".to_string(), p.own.clone())];
        (html::render(&html::build(&p, name, &configs, None, &p.recorded_placement())), p)
    };
    let (changed, p) = page("traces/field/test_cuda/settings_midrun__default.pickle.gz");
    let n = p.not_reproduced().expect("settings_midrun's replay is not the recording");
    assert!(!n.settings_changed.is_empty());
    assert!(changed.contains("id=\"not-reproduced\""), "no warning on the page");
    for why in &n.settings_changed {
        assert!(changed.contains(&why.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")), "{why} not on the page");
    }
    assert!(changed.contains(&format!("model of PyTorch {}'s", p.rules.version)));
    let (reproduced, p) = page("traces/frag__default__2048M.pickle.gz");
    assert!(p.not_reproduced().is_none(), "frag__default__2048M is reproduced");
    assert!(!reproduced.contains("id=\"not-reproduced\""));
}
