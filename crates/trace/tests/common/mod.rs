//! Helpers shared by the integration tests.
#![allow(dead_code)]

use allocsim_trace::pickle::{Decoded, Value};
use std::path::PathBuf;

pub fn fixture(rel: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(rel);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e} (run tests/fixtures/gen_fixtures.py)", p.display()))
}

#[path = "../../../../tests/support/reference.rs"]
pub mod reference;

/// Path of a real trace under the shared folder next to the workspace; `None` (with a note) if
/// absent and not required.
pub fn real_trace(name: &str) -> Option<PathBuf> {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    reference::shared(&repo, &format!("traces/{name}"))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Decimal rendering of a little-endian two's-complement integer of any size.
pub fn le_twos_to_decimal(b: &[u8]) -> String {
    let neg = b.last().is_some_and(|&x| x & 0x80 != 0);
    let mut mag: Vec<u8> = b.to_vec();
    if neg {
        let mut carry = 1u16;
        for x in mag.iter_mut() {
            let v = (!*x) as u16 + carry;
            *x = v as u8;
            carry = v >> 8;
        }
    }
    // big-endian base-256 digits → repeated division by 10
    let mut digits: Vec<u8> = mag.iter().rev().copied().collect();
    let mut out = Vec::new();
    while digits.iter().any(|&d| d != 0) {
        let mut rem = 0u32;
        for d in digits.iter_mut() {
            let cur = rem * 256 + *d as u32;
            *d = (cur / 10) as u8;
            rem = cur % 10;
        }
        out.push(b'0' + rem as u8);
    }
    if out.is_empty() {
        out.push(b'0');
    }
    if neg {
        out.push(b'-');
    }
    out.reverse();
    String::from_utf8(out).unwrap()
}

/// The canonical form of gen_fixtures.py's `canon()`.
pub fn canon(d: &Decoded<'_>, v: Value, depth: usize) -> String {
    assert!(depth < 64, "unexpectedly deep value");
    let seq = |open: &str, close: &str, sort: bool| {
        let mut items: Vec<String> = d.items(v).unwrap().iter().map(|&x| canon(d, x, depth + 1)).collect();
        if sort {
            items.sort();
        }
        format!("{open}{}{close}", items.join(","))
    };
    match v {
        Value::None => "N".into(),
        Value::Bool(true) => "T".into(),
        Value::Bool(false) => "F".into(),
        Value::Int(i) => format!("i{i}"),
        Value::BigInt { .. } => format!("i{}", le_twos_to_decimal(d.bigint_bytes(v).unwrap())),
        Value::Float(f) => format!("f{}", hex(&f.to_be_bytes())),
        Value::Str { .. } => format!("s{}", hex(d.str(v).expect("valid str").as_bytes())),
        Value::Bytes { .. } => format!("b{}", hex(d.bytes(v).unwrap())),
        Value::List(_) => seq("[", "]", false),
        Value::Tuple(_) => seq("(", ")", false),
        Value::Set(_) => seq("S{", "}", true),
        Value::FrozenSet(_) => seq("F{", "}", true),
        Value::Dict(_) => {
            let items: Vec<String> = d.dict(v).unwrap().iter().map(|&(k, x)| format!("{}:{}", canon(d, k, depth + 1), canon(d, x, depth + 1))).collect();
            format!("{{{}}}", items.join(","))
        }
    }
}
