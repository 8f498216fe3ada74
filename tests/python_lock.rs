//! The Python package (python/) is a workspace of its own with its own `Cargo.lock`, which the
//! Rust workspace's `cargo test` never resolves; `pip install ./python` builds it with `--locked`.
//! A dependency added to one of the allocsim crates and not to python/Cargo.lock therefore passes
//! every Rust test and fails only the install. This checks, without the network, that each allocsim
//! crate's normal dependencies (its `[dependencies]` and `[target.*.dependencies]`, less optional
//! ones) are the ones
//! python/Cargo.lock records for it, and that every allocsim crate the package reaches is in it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Package name → dependency names, from a Cargo.lock (`"name version"` entries keep the name).
fn lock_packages(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out = BTreeMap::new();
    for block in text.split("[[package]]").skip(1) {
        let mut name = None;
        let mut deps = BTreeSet::new();
        let mut in_deps = false;
        for line in block.lines() {
            let line = line.trim();
            if let Some(n) = line.strip_prefix("name = ") {
                name = Some(n.trim_matches('"').to_string());
            } else if line.starts_with("dependencies = [") {
                in_deps = true;
            } else if in_deps && line == "]" {
                in_deps = false;
            } else if in_deps {
                let dep = line.trim_end_matches(',').trim_matches('"');
                deps.insert(dep.split(' ').next().unwrap_or(dep).to_string());
            }
        }
        out.insert(name.expect("a [[package]] without a name"), deps);
    }
    out
}

/// The names under `[dependencies]` and `[target.'…'.dependencies]` of a Cargo.toml.
fn manifest_dependencies(path: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut out = BTreeSet::new();
    let mut in_deps = false;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_deps = line == "[dependencies]" || (line.starts_with("[target.") && line.ends_with(".dependencies]"));
            assert!(!line.starts_with("[dependencies."), "{}: a [dependencies.NAME] table is not read by this test", path.display());
            continue;
        }
        // An optional dependency is resolved only where a feature turns it on, which the
        // package's build does not (`cuda`).
        if in_deps && !line.is_empty() && !line.starts_with('#') && !line.contains("optional = true") {
            let key = line.split(['=', '.']).next().unwrap().trim();
            out.insert(key.to_string());
        }
    }
    out
}

fn manifest_of(package: &str) -> Option<PathBuf> {
    let repo = repo();
    match package {
        "allocsim" => Some(repo.join("Cargo.toml")),
        "allocsim-python" => Some(repo.join("python/Cargo.toml")),
        p => p.strip_prefix("allocsim-").map(|c| repo.join("crates").join(c).join("Cargo.toml")),
    }
}

#[test]
fn python_lock_records_every_allocsim_crates_dependencies() {
    let lock = std::fs::read_to_string(repo().join("python/Cargo.lock")).unwrap();
    let packages = lock_packages(&lock);
    assert!(packages.contains_key("allocsim-python"), "python/Cargo.lock has no allocsim-python");
    let mut checked = 0;
    // Every allocsim crate the package reaches, from its own manifest outwards.
    let mut todo = vec!["allocsim-python".to_string()];
    let mut seen = BTreeSet::new();
    let mut problems = Vec::new();
    while let Some(p) = todo.pop() {
        if !seen.insert(p.clone()) {
            continue;
        }
        let manifest = manifest_of(&p).unwrap();
        let declared = manifest_dependencies(&manifest);
        match packages.get(&p) {
            None => problems.push(format!("{p} is missing from python/Cargo.lock")),
            Some(locked) if locked != &declared => {
                problems.push(format!("{p}: {} declares {declared:?}, python/Cargo.lock records {locked:?}", manifest.display()))
            }
            Some(_) => {}
        }
        checked += 1;
        todo.extend(declared.into_iter().filter(|d| d.starts_with("allocsim")));
    }
    assert!(
        problems.is_empty(),
        "python/Cargo.lock is out of date (run `cargo metadata --manifest-path python/Cargo.toml` \
         and commit it):\n{}",
        problems.join("\n")
    );
    // The package reaches the library, the commands and every crate below them.
    assert!(checked >= 10, "only {checked} allocsim crates reached from python/Cargo.toml");
}

#[test]
fn the_check_sees_a_missing_dependency() {
    let lock = "[[package]]\nname = \"a\"\nversion = \"0.1.0\"\ndependencies = [\n \"b\",\n \"c 1.0.0\",\n]\n";
    let p = lock_packages(lock);
    assert_eq!(p["a"], BTreeSet::from(["b".to_string(), "c".to_string()]));
    let dir = std::env::temp_dir().join(format!("allocsim-lock-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let m = dir.join("Cargo.toml");
    std::fs::write(
        &m,
        "[package]\nname = \"a\"\n[dependencies]\nb.workspace = true\nc = \"1\"\nd = { version = \"2\" }\n\
         g = { version = \"1\", optional = true }\n\
         [target.'cfg(unix)'.dependencies]\ne = \"0.2\"\n[dev-dependencies]\nf = \"1\"\n",
    )
    .unwrap();
    let declared = manifest_dependencies(&m);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(declared, ["b", "c", "d", "e"].map(String::from).into_iter().collect());
    assert_ne!(declared, p["a"], "a lock without d and e must not pass");
}
