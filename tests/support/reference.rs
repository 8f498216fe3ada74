//! The reference data beside the checkout (`../shared`: real H200 traces and the scripted probe
//! cases), for the tests that check against it.
//!
//! Where the data is absent a test that needs it is skipped with a note on stderr, unless
//! `ALLOCSIM_REQUIRE_SHARED=1` (which `.ci/run` sets) makes that a failure. A test that finds the
//! data also checks that it found as much as the data set holds ([`expect_count`]), so a data set
//! that shrank, or a filter that matches less, fails rather than passes on less.
//!
//! Included by path (`#[path = ".../tests/support/reference.rs"] mod reference;`) in the test
//! crates of the workspace that use the data.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// Runs in `../shared/traces` (`*.pickle.gz`, each with its `.json`).
pub const SHARED_TRACE_RUNS: usize = 32;
/// Cases in `../shared/reference/probe-cases/oracle_cases_2.11.json` and
/// `oracle_cases_extra_2.11.json`.
pub const PROBE_CASES: usize = 45;

/// Whether the reference data must be present (`ALLOCSIM_REQUIRE_SHARED=1`).
pub fn required() -> bool {
    std::env::var("ALLOCSIM_REQUIRE_SHARED").is_ok_and(|v| v == "1")
}

/// `../shared/<rel>` next to the repository at `repo`, if it exists. Absent: a note and `None`,
/// or a panic when the data is required.
pub fn shared(repo: &Path, rel: &str) -> Option<PathBuf> {
    let p = repo.join("..").join("shared").join(rel);
    if p.exists() {
        return Some(p);
    }
    assert!(!required(), "{} is missing, and ALLOCSIM_REQUIRE_SHARED=1 requires it", p.display());
    eprintln!("note: {} not found; skipping what needs it (ALLOCSIM_REQUIRE_SHARED=1 makes this an error)", p.display());
    None
}

/// The count a test expects to check: `with_shared` when the reference data was found, else
/// `without` (the repository's own files alone, as a bare clone has them). Both are measured
/// counts, written down where the test uses them.
pub fn expected(shared_found: bool, with_shared: usize, without: usize) -> usize {
    if shared_found { with_shared } else { without }
}

/// Fails unless at least `expected` `what` were found and checked.
pub fn expect_count(what: &str, found: usize, expected: usize) {
    assert!(found >= expected, "checked {found} {what}, expected at least {expected}: is the reference data complete?");
}
