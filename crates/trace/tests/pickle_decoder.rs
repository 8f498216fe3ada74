//! The non-executing pickle decoder against fixtures pickled by CPython (tests/fixtures/gen_fixtures.py)
//! and against hand-made malformed input.

mod common;

use allocsim_trace::pickle::{self, Value, decode, opcode_name};
use common::{canon, fixture};
use proptest::prelude::*;

#[test]
fn value_is_16_bytes() {
    assert_eq!(std::mem::size_of::<Value>(), 16);
}

/// Every fixture decodes to exactly what CPython pickled (protocols 0–5; random nested values with
/// shared references; big ints; floats; unicode; >256 memo entries; several FRAMEs).
#[test]
fn fixtures_match_cpython() {
    let manifest = String::from_utf8(fixture("values/manifest.txt")).unwrap();
    let mut n = 0;
    for line in manifest.lines().filter(|l| !l.is_empty()) {
        let (file, expected) = line.split_once('\t').unwrap();
        let bytes = fixture(file);
        let d = decode(&bytes).unwrap_or_else(|e| panic!("{file}: {e}"));
        let got = canon(&d, d.root(), 0);
        assert!(got == expected, "{file}: decoded value differs from CPython's\n got: {got}\nwant: {expected}");
        n += 1;
    }
    assert!(n >= 30, "only {n} fixtures in the manifest");
}

#[test]
fn protocols_2_to_5_present() {
    for p in 2..=5 {
        let b = fixture(&format!("values/fixed_p{p}.pickle"));
        assert_eq!(&b[..2], &[0x80, p as u8]);
        decode(&b).unwrap();
    }
}

/// `k="key"; d={k:1}; pickle.dumps([d, d, {k:2}])`: the shape that breaks serde-pickle.
#[test]
fn shared_memo_is_shared() {
    for p in 2..=5 {
        let b = fixture(&format!("values/shared_p{p}.pickle"));
        let d = decode(&b).unwrap();
        let items = d.items(d.root()).unwrap();
        assert_eq!(items.len(), 3);
        assert!(matches!(items[0], Value::Dict(_)));
        assert_eq!(items[0], items[1], "protocol {p}: the same dict object must decode to the same handle");
        assert_ne!(items[0], items[2]);
        assert_eq!(d.dict_get(items[1], "key"), Some(Value::Int(1)));
        assert_eq!(d.dict_get(items[2], "key"), Some(Value::Int(2)));
        // the key string itself is shared too
        assert_eq!(d.dict(items[0]).unwrap()[0].0, d.dict(items[2]).unwrap()[0].0);
    }
}

#[test]
fn big_ints() {
    // pickle.dumps([2**63+5, -2**70, 2**64-1, 2**63-1, -2**63], protocol=2)
    let mut b = vec![0x80, 2, b']', b'('];
    let long1 = |b: &mut Vec<u8>, v: &[u8]| {
        b.push(0x8a);
        b.push(v.len() as u8);
        b.extend_from_slice(v);
    };
    long1(&mut b, &[5, 0, 0, 0, 0, 0, 0, 0x80, 0]); // 2**63+5
    long1(&mut b, &[0, 0, 0, 0, 0, 0, 0, 0, 0xc0]); // -2**70
    long1(&mut b, &[0xff; 8].iter().copied().chain([0]).collect::<Vec<_>>()); // 2**64-1
    long1(&mut b, &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]); // 2**63-1
    long1(&mut b, &[0, 0, 0, 0, 0, 0, 0, 0x80]); // -2**63
    long1(&mut b, &[]); // 0
    b.extend_from_slice(b"e.");
    let d = decode(&b).unwrap();
    let it = d.items(d.root()).unwrap();
    assert!(matches!(it[0], Value::BigInt { .. }));
    assert_eq!(d.int_u64(it[0]), Some((1u64 << 63) + 5));
    assert_eq!(d.int_i64(it[0]), None);
    assert!(matches!(it[1], Value::BigInt { .. }));
    assert_eq!(d.int_u64(it[1]), None);
    assert_eq!(d.int_i128(it[1]), Some(-(1i128 << 70)));
    assert_eq!(d.int_u64(it[2]), Some(u64::MAX));
    assert_eq!(it[3], Value::Int(i64::MAX));
    assert_eq!(it[4], Value::Int(i64::MIN));
    assert_eq!(it[5], Value::Int(0));
    assert_eq!(d.int_u64(it[4]), None);
}

#[test]
fn ints_beyond_i128_are_kept_as_bytes() {
    let b = fixture("values/fixed_p2.pickle");
    let d = decode(&b).unwrap();
    let ints = d.items(d.dict_get(d.root(), "ints").unwrap()).unwrap();
    // 2**100 and -(2**127) are BigInts; int_i128 handles both; int_u64 neither.
    let big: Vec<_> = ints.iter().filter(|v| matches!(v, Value::BigInt { .. })).collect();
    assert!(big.len() >= 6, "{big:?}");
    assert!(big.iter().all(|&&v| d.int_i128(v).is_some()));
    assert_eq!(common::le_twos_to_decimal(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10]), (1u128 << 100).to_string());
}

#[test]
fn floats_and_nested_tuples() {
    let b = fixture("values/fixed_p4.pickle");
    let d = decode(&b).unwrap();
    let f = d.items(d.dict_get(d.root(), "floats").unwrap()).unwrap();
    assert_eq!(f[2], Value::Float(1.5));
    assert_eq!(f[6], Value::Float(f64::INFINITY));
    assert!(matches!(f[1], Value::Float(z) if z == 0.0 && z.is_sign_negative()));
    let t = d.items(d.dict_get(d.root(), "tuples").unwrap()).unwrap();
    // ((((),),),)
    let mut v = t[5];
    for _ in 0..3 {
        let items = d.items(v).unwrap();
        assert!(matches!(v, Value::Tuple(_)));
        assert_eq!(items.len(), 1);
        v = items[0];
    }
    assert_eq!(d.items(v).unwrap().len(), 0);
}

fn err_of(b: &[u8]) -> pickle::PickleError {
    match decode(b) {
        Ok(d) => panic!("expected an error, decoded {}", d.depth_limited_repr(d.root(), 3, 100)),
        Err(e) => e,
    }
}

#[test]
fn refuses_object_construction_fixtures() {
    for (file, op, at) in [
        ("refuse/ordered_dict_p2.pickle", "GLOBAL (0x63)", 2),
        ("refuse/ordered_dict_p4.pickle", "STACK_GLOBAL (0x93)", 39),
        ("refuse/complex_p2.pickle", "GLOBAL (0x63)", 2),
        ("refuse/counter_in_list_p5.pickle", "STACK_GLOBAL (0x93)", 44),
    ] {
        let e = err_of(&fixture(file));
        assert_eq!(e.offset, at, "{file}: {e}");
        let s = e.to_string();
        assert!(s.contains(op) && s.contains("never executes"), "{file}: {s}");
    }
}

#[test]
fn refuses_every_object_opcode() {
    let refused: &[(u8, &str)] = &[
        (b'c', "GLOBAL"),
        (0x93, "STACK_GLOBAL"),
        (b'R', "REDUCE"),
        (b'b', "BUILD"),
        (b'i', "INST"),
        (b'o', "OBJ"),
        (0x81, "NEWOBJ"),
        (0x92, "NEWOBJ_EX"),
        (b'P', "PERSID"),
        (b'Q', "BINPERSID"),
        (0x82, "EXT1"),
        (0x83, "EXT2"),
        (0x84, "EXT4"),
        (0x97, "NEXT_BUFFER"),
        (0x98, "READONLY_BUFFER"),
    ];
    for &(op, name) in refused {
        assert_eq!(opcode_name(op), Some(name));
        // PROTO 5, NONE, EMPTY_TUPLE, <op>, ...
        let b = [0x80, 5, b'N', b')', op, b'N', b'.'];
        let e = err_of(&b);
        assert_eq!(e.offset, 4);
        let want = format!("pickle opcode {name} (0x{op:02x}) at byte 4 would construct a Python object");
        assert!(e.msg.contains(&want), "{e}");
    }
}

#[test]
fn malformed_inputs_are_errors() {
    let cases: &[(&[u8], usize, &str)] = &[
        (b"", 0, "before the STOP"),
        (b"\x80\x02", 2, "before the STOP"),
        (b"\x80\x06N.", 0, "unsupported pickle protocol 6"),
        (b"\x80\x02\xff", 2, "unknown pickle opcode 0xff"),
        (b"\x80\x02.", 2, "underflow"),
        (b"\x80\x02a.", 2, "underflow"),
        (b"\x80\x02K\x01K\x02a.", 6, "APPEND to a int"),
        (b"\x80\x02}K\x01s.", 5, "underflow"),
        (b"\x80\x02K\x01K\x02K\x03s.", 8, "SETITEM on a int"),
        (b"\x80\x02(e.", 3, "no container below the MARK"),
        (b"\x80\x02K\x01(K\x02e.", 7, "APPENDS to a int"),
        (b"\x80\x02}(K\x01u.", 6, "odd number"),
        (b"\x80\x02](K\x01\x90.", 6, "ADDITEMS to a list"),
        (b"\x80\x02t.", 2, "no MARK"),
        (b"\x80\x021.", 2, "no MARK"),
        (b"\x80\x02h\x05.", 2, "memo key 5 not found"),
        (b"\x80\x02j\x00\x00\x00\x01.", 2, "memo key 16777216 not found"),
        (b"\x80\x02\x94.", 2, "underflow"),
        (b"\x80\x02(\x85.", 3, "underflow"),
        (b"\x80\x02\x85.", 2, "underflow"),
        (b"\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\x7f.", 2, "declares"),
        (b"\x80\x04\x95\xff\xff\xff\xff\xff\xff\xff\xffN.", 2, "declares"),
        (b"\x80\x04\x8e\x00\x00\x00\x00\x01\x00\x00\x00.", 2, "declares"),
        (b"\x80\x04\x96\x10\x00\x00\x00\x00\x00\x00\x00ab.", 2, "declares"),
        (b"\x80\x02X\xff\xff\xff\xffabc.", 2, "declares"),
        (b"\x80\x02B\x05\x00\x00\x00ab", 2, "declares"),
        (b"\x80\x02\x8b\xff\xff\xff\xff.", 2, "negative byte count"),
        (b"\x80\x02\x8b\x10\x00\x00\x00\x01.", 2, "declares"),
        (b"\x80\x02\x8a\x09\x01.", 2, "needs 9 bytes"),
        (b"\x80\x02J\x01\x02", 2, "needs 4 bytes"),
        (b"\x80\x02G\x01\x02", 2, "needs 8 bytes"),
        (b"\x80\x02\x8c\x02\xff\xfe.", 2, "not valid UTF-8"),
        (b"\x80\x02T\xff\xff\xff\xff.", 2, "negative length"),
        (b"I12", 0, "no terminating newline"),
        (b"Ix1\n.", 0, "invalid integer"),
        (b"Fnope\n.", 0, "invalid literal"),
        (b"Sabc\n.", 0, "must be quoted"),
        (b"gx\n.", 0, "invalid memo index"),
        (b"V\\u12\n.", 0, "truncated"),
        (b"V\\ud800\n.", 0, "not a Unicode scalar"),
    ];
    for &(b, at, want) in cases {
        let e = err_of(b);
        assert!(e.offset == at && e.msg.contains(want), "{:?}: got {e:?}, wanted offset {at} and {want:?}", String::from_utf8_lossy(b));
    }
}

#[test]
fn deep_nesting_is_bounded() {
    let mut b = vec![0x80, 2];
    b.extend(std::iter::repeat_n(b'(', pickle::MAX_MARK_DEPTH + 1));
    let e = err_of(&b);
    assert!(e.msg.contains("nesting deeper"), "{e}");
    assert_eq!(e.offset, 2 + pickle::MAX_MARK_DEPTH);

    // 200k nested lists (EMPTY_LIST ... APPEND ...) decode without recursion; rendering is bounded.
    let n = 200_000;
    let mut b = vec![0x80, 2];
    b.extend(std::iter::repeat_n(b']', n));
    b.extend(std::iter::repeat_n(b'a', n - 1));
    b.push(b'.');
    let d = decode(&b).unwrap();
    let r = d.depth_limited_repr(d.root(), 50, 1000);
    assert!(r.starts_with("[[[[") && r.len() < 1100, "{r}");
}

#[test]
fn cycles_decode_and_render() {
    // l = []; l.append(l); pickle.dumps(l, 2)
    let b = b"\x80\x02]q\x00h\x00a.";
    let d = decode(b).unwrap();
    let root = d.root();
    assert_eq!(d.items(root).unwrap(), &[root]);
    let r = d.depth_limited_repr(root, 10, 200);
    assert!(r.contains("…1 items"), "{r}");
}

#[test]
fn text_protocol_strings() {
    let d = decode(
        b"(S'ab\\x41\\n\\'q'\np0\nS\"\\101\\\\\"\nT\x03\x00\x00\x00abcU\x02\xff\xfeV\\u00e9t\\u65e5\\U0001F389\\\\u\nI01\nI00\nL-18446744073709551616L\ng0\nl.",
    )
    .unwrap();
    let it = d.items(d.root()).unwrap();
    assert_eq!(d.str(it[0]), Some("abA\n'q"));
    assert_eq!(d.str(it[1]), Some("A\\"));
    assert_eq!(d.str(it[2]), Some("abc"));
    assert_eq!(d.bytes(it[3]), Some(&b"\xff\xfe"[..]));
    assert_eq!(d.str(it[4]), Some("ét日🎉\\\\u"));
    assert_eq!(it[5], Value::Bool(true));
    assert_eq!(it[6], Value::Bool(false));
    assert_eq!(d.int_i128(it[7]), Some(-(1i128 << 64)));
    assert_eq!(it[8], it[0]);
}

#[test]
fn trailing_bytes_after_stop_are_ignored() {
    let d = decode(b"\x80\x02K\x07.garbage").unwrap();
    assert_eq!(d.root(), Value::Int(7));
}

/// Every proper prefix of a pickle is an error (never a panic); so is every prefix fed to the
/// snapshot converter.
#[test]
fn truncation_at_every_prefix() {
    for f in ["values/fixed_p0.pickle", "values/fixed_p2.pickle", "values/random1_p5.pickle", "snap/small_p4.pickle"] {
        let b = fixture(f);
        decode(&b).unwrap();
        for n in 0..b.len() {
            let e = decode(&b[..n]).expect_err("a truncated pickle must not decode");
            assert!(e.offset <= n, "{f}[..{n}]: offset {} beyond the input", e.offset);
            assert!(allocsim_trace::snapshot::from_pickle(&b[..n]).is_err());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// Corrupting bytes of real pickles gives a value or an error at a byte offset within the
    /// input; the snapshot converter, a snapshot or an error that names the byte or the entry
    /// (and a snapshot only from a pickle that decodes).
    #[test]
    fn mutations_never_panic(which in 0usize..3, edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6)) {
        let f = ["snap/small_p4.pickle", "values/fixed_p2.pickle", "values/random2_p0.pickle"][which];
        let mut b = fixture(f);
        for (i, v) in edits {
            let i = i.index(b.len());
            b[i] = v;
        }
        let decoded = decode(&b);
        match &decoded {
            Ok(d) => {
                let _ = d.depth_limited_repr(d.root(), 8, 500);
            }
            Err(e) => clean_pickle_error(e, &b)?,
        }
        match allocsim_trace::snapshot::from_pickle(&b) {
            Ok(_) => prop_assert!(decoded.is_ok(), "a snapshot from a pickle that does not decode"),
            Err(e) => {
                let m = e.to_string();
                match e {
                    allocsim_trace::TraceError::Pickle(p) => clean_pickle_error(&p, &b)?,
                    // (It may quote the file's own strings, newlines and all: the command line
                    // escapes control characters to keep its error to one line.)
                    allocsim_trace::TraceError::NotSnapshot(why) => prop_assert!(decoded.is_ok() && !why.is_empty(), "{m}"),
                    other => prop_assert!(false, "unexpected error kind: {other}"),
                }
            }
        }
    }

    /// Random bytes (bare, and after a protocol-2 header): a value or an error at an offset
    /// within the input, never a panic.
    #[test]
    fn random_bytes_never_panic(mut b in proptest::collection::vec(any::<u8>(), 0..200)) {
        if let Err(e) = decode(&b) {
            clean_pickle_error(&e, &b)?;
        }
        b.insert(0, 2);
        b.insert(0, 0x80);
        if let Err(e) = decode(&b) {
            clean_pickle_error(&e, &b)?;
        }
    }
}

/// A decoder error as the command line prints it: one line naming a byte offset within the input.
fn clean_pickle_error(e: &pickle::PickleError, input: &[u8]) -> Result<(), TestCaseError> {
    let m = e.to_string();
    prop_assert!(e.offset <= input.len(), "offset {} beyond the input ({} bytes): {m}", e.offset, input.len());
    prop_assert!(!e.msg.is_empty() && !m.contains('\n'), "not one line: {m:?}");
    prop_assert!(m.contains(&format!("byte {}", e.offset)), "names no byte offset: {m}");
    Ok(())
}
