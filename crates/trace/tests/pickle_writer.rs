//! The pickle writer: opcode choices, batching, framing and memo sharing; everything it writes
//! decodes (with our decoder) to the value written; and where `python3` is available, CPython
//! loads it and re-pickles it to the very same bytes.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

use allocsim_trace::pickle::{self, Decoded, Value};
use allocsim_trace::pickle_write::{MemoId, Pickler, PyValue, dumps};
use common::{canon, fixture, le_twos_to_decimal};
use proptest::prelude::*;
use proptest::strategy::ValueTree;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// `canon()` of gen_fixtures.py for a [`PyValue`].
fn py_canon(v: &PyValue) -> String {
    let seq = |open: &str, close: &str, items: &[PyValue], sort: bool| {
        let mut s: Vec<String> = items.iter().map(py_canon).collect();
        if sort {
            s.sort();
        }
        format!("{open}{}{close}", s.join(","))
    };
    match v {
        PyValue::None => "N".into(),
        PyValue::Bool(true) => "T".into(),
        PyValue::Bool(false) => "F".into(),
        PyValue::Int(i) => format!("i{i}"),
        PyValue::BigInt(b) if b.is_empty() => "i0".into(),
        PyValue::BigInt(b) => format!("i{}", le_twos_to_decimal(b)),
        PyValue::Float(f) => format!("f{}", hex(&f.to_be_bytes())),
        PyValue::Str(s) => format!("s{}", hex(s.as_bytes())),
        PyValue::Bytes(b) => format!("b{}", hex(b)),
        PyValue::List(x) => seq("[", "]", x, false),
        PyValue::Tuple(x) => seq("(", ")", x, false),
        PyValue::Set(x) => seq("S{", "}", x, true),
        PyValue::FrozenSet(x) => seq("F{", "}", x, true),
        PyValue::Dict(pairs) => {
            let s: Vec<String> = pairs.iter().map(|(k, x)| format!("{}:{}", py_canon(k), py_canon(x))).collect();
            format!("{{{}}}", s.join(","))
        }
    }
}

fn roundtrip(v: &PyValue) -> Vec<u8> {
    let b = dumps(v);
    let d = pickle::decode(&b).unwrap_or_else(|e| panic!("{e} for {v:?}"));
    assert_eq!(canon(&d, d.root(), 0), py_canon(v));
    b
}

/// Re-pickles a decoded value with the writer, keeping shared containers shared.
struct Reencode<'d, 'a> {
    d: &'d Decoded<'a>,
    seqs: HashMap<u32, MemoId>,
    dicts: HashMap<u32, MemoId>,
}

impl Reencode<'_, '_> {
    fn val(&mut self, p: &mut Pickler, v: Value) {
        let d = self.d;
        match v {
            Value::None => p.none(),
            Value::Bool(b) => p.bool(b),
            Value::Int(i) => p.int(i),
            Value::BigInt { .. } => p.bigint_le(d.bigint_bytes(v).unwrap()),
            Value::Float(f) => p.float(f),
            Value::Str { .. } => p.str(d.str(v).unwrap()),
            Value::Bytes { .. } => p.bytes(d.bytes(v).unwrap()),
            Value::List(id) | Value::Set(id) | Value::Tuple(id) | Value::FrozenSet(id) => {
                if let Some(&m) = self.seqs.get(&id) {
                    return p.get(m);
                }
                let items = d.items(v).unwrap();
                let before = p.memo_len();
                let m = match v {
                    Value::List(_) => {
                        self.seqs.insert(id, before);
                        p.list(items, |p, &x| self.val(p, x))
                    }
                    Value::Set(_) => {
                        self.seqs.insert(id, before);
                        p.set(items, |p, &x| self.val(p, x))
                    }
                    Value::Tuple(_) => p.tuple(items, |p, &x| self.val(p, x)),
                    _ => p.frozenset(items, |p, &x| self.val(p, x)),
                };
                if let Some(m) = m {
                    self.seqs.insert(id, m);
                }
            }
            Value::Dict(id) => {
                if let Some(&m) = self.dicts.get(&id) {
                    return p.get(m);
                }
                self.dicts.insert(id, p.memo_len());
                p.dict(d.dict(v).unwrap(), |p, &(k, x)| {
                    self.val(p, k);
                    self.val(p, x);
                });
            }
        }
    }
}

fn reencode(d: &Decoded<'_>) -> Vec<u8> {
    let mut p = Pickler::new();
    Reencode { d, seqs: HashMap::new(), dicts: HashMap::new() }.val(&mut p, d.root());
    p.finish()
}

fn s(x: &str) -> PyValue {
    PyValue::Str(x.into())
}

fn i(x: i128) -> PyValue {
    PyValue::Int(x)
}

/// `(offset, length)` of every FRAME, following the chain of frames from the first one.
fn frames(b: &[u8]) -> Vec<(usize, u64)> {
    let mut out = Vec::new();
    let mut at = 2;
    while at + 9 <= b.len() && b[at] == 0x95 {
        let n = u64::from_le_bytes(b[at + 1..at + 9].try_into().unwrap());
        out.push((at, n));
        at += 9 + n as usize;
    }
    out
}

#[test]
fn exact_bytes_of_small_values() {
    // Expected bytes are CPython 3.11's pickle.dumps(v, protocol=4).
    let cases: Vec<(PyValue, &str)> = vec![
        (PyValue::None, "80044e2e"),
        (PyValue::Bool(true), "8004882e"),
        (i(0), "80044b002e"),
        (i(255), "80044bff2e"),
        (i(256), "80049504000000000000004d00012e"),
        (i(65535), "80049504000000000000004dffff2e"),
        (i(-1), "80049506000000000000004affffffff2e"),
        (i(65536), "80049506000000000000004a000001002e"),
        (i(1 << 31), "80049508000000000000008a0500000080002e"),
        (i(-(1 << 63)), "8004950b000000000000008a0800000000000000802e"),
        (i(u64::MAX as i128), "8004950c000000000000008a09ffffffffffffffff002e"),
        (PyValue::Float(1.5), "8004950a00000000000000473ff80000000000002e"),
        (s(""), "80049504000000000000008c00942e"),
        (s("héllo"), "8004950a000000000000008c0668c3a96c6c6f942e"),
        (PyValue::Bytes(vec![0, 255]), "8004950600000000000000430200ff942e"),
        (PyValue::List(vec![]), "80045d942e"),
        (PyValue::List(vec![i(1)]), "80049506000000000000005d944b01612e"),
        (PyValue::List(vec![i(1), i(2)]), "80049509000000000000005d94284b014b02652e"),
        (PyValue::Tuple(vec![]), "8004292e"),
        (PyValue::Tuple(vec![i(1), i(2)]), "80049507000000000000004b014b0286942e"),
        (PyValue::Tuple(vec![i(1), i(2), i(3), i(4)]), "8004950c00000000000000284b014b024b034b0474942e"),
        (PyValue::Dict(vec![(s("a"), i(1))]), "8004950a000000000000007d948c0161944b01732e"),
        (PyValue::List(vec![s("ab"), s("ab")]), "8004950c000000000000005d94288c026162946801652e"),
    ];
    for (v, want) in cases {
        assert_eq!(hex(&roundtrip(&v)), want, "{v:?}");
    }
}

#[test]
fn ints_at_every_opcode_boundary() {
    let mut vals = vec![0i128, 1, 255, 256, 65535, 65536, -1, -128, -129, -255, -256, -65536];
    vals.extend([i32::MAX as i128, i32::MIN as i128, i32::MAX as i128 + 1, i32::MIN as i128 - 1]);
    vals.extend([i64::MAX as i128, i64::MIN as i128, i64::MAX as i128 + 1, i64::MIN as i128 - 1]);
    vals.extend([u64::MAX as i128, u64::MAX as i128 + 1, i128::MAX, i128::MIN, 1 << 100, -(1 << 100)]);
    for v in vals {
        roundtrip(&i(v));
        // the same value given as (non-minimal) bytes writes the same pickle
        let mut le = v.to_le_bytes().to_vec();
        le.extend([if v < 0 { 0xff } else { 0 }; 3]);
        assert_eq!(dumps(&PyValue::BigInt(le)), dumps(&i(v)), "{v}");
    }
    // beyond i128, and LONG4 (more than 255 bytes)
    for n in [17usize, 100, 255, 256, 300] {
        for top in [0x01u8, 0x7f, 0x80, 0xfe] {
            let mut b = vec![0xa5u8; n];
            b[n - 1] = top;
            roundtrip(&PyValue::BigInt(b.clone()));
            let out = dumps(&PyValue::BigInt(b.clone()));
            // PROTO, FRAME header, then LONG1 / LONG4 with all n bytes (already minimal)
            let (op, len_at) = if n < 256 { (0x8a, 13) } else { (0x8b, 16) };
            assert_eq!(out[11], op, "n={n} top={top:#x}");
            assert_eq!(&out[len_at..len_at + n], &b[..]);
        }
    }
    roundtrip(&PyValue::BigInt(vec![]));
}

#[test]
fn floats_keep_their_bits() {
    for bits in [0u64, 1 << 63, 0x7ff0_0000_0000_0000, 0xfff0_0000_0000_0000, 0x7ff8_0000_0000_0001, 1] {
        roundtrip(&PyValue::Float(f64::from_bits(bits)));
    }
}

#[test]
fn strings_and_bytes_at_length_boundaries() {
    for n in [0usize, 1, 255, 256, 65535, 65536, 70000] {
        let st = "é".repeat(n / 2) + &"x".repeat(n % 2);
        let b = roundtrip(&s(&st));
        let op = if st.len() < 256 { 0x8c } else { b'X' };
        assert!(b.contains(&op));
        let by = vec![7u8; n];
        roundtrip(&PyValue::Bytes(by));
    }
}

#[test]
fn batches_like_cpython() {
    /// Counts opcode `op` in a pickle made of argument-less opcodes, NONE, PROTO and FRAME.
    fn count(b: &[u8], op: u8) -> usize {
        let (mut at, mut n) = (0, 0);
        while at < b.len() {
            let o = b[at];
            n += (o == op) as usize;
            at += match o {
                0x80 => 2,
                0x95 => 9,
                _ => 1,
            };
        }
        n
    }
    for n in [0usize, 1, 2, 999, 1000, 1001, 2000, 2001] {
        let list = PyValue::List(vec![PyValue::None; n]);
        let b = roundtrip(&list);
        let (marks, appends, append) = (count(&b, b'('), count(&b, b'e'), count(&b, b'a'));
        match n {
            0 => assert_eq!((marks, appends, append), (0, 0, 0)),
            1 => assert_eq!((marks, appends, append), (0, 0, 1)),
            _ => {
                let batches = n.div_ceil(1000);
                assert_eq!((marks, appends, append), (batches, batches, 0), "list of {n}");
            }
        }
        let dict = PyValue::Dict(vec![(PyValue::None, PyValue::None); n]);
        let b = roundtrip(&dict);
        let (marks, setitems, setitem) = (count(&b, b'('), count(&b, b'u'), count(&b, b's'));
        match n {
            0 => assert_eq!((marks, setitems, setitem), (0, 0, 0)),
            1 => assert_eq!((marks, setitems, setitem), (0, 0, 1)),
            // CPython's C pickler writes an extra empty batch after a full last batch
            _ => {
                let batches = n / 1000 + 1;
                assert_eq!((marks, setitems, setitem), (batches, batches, 0), "dict of {n}");
            }
        }
        let set = PyValue::Set((0..n).map(|k| i(k as i128 % 100)).collect());
        roundtrip(&set);
        roundtrip(&PyValue::FrozenSet((0..n.min(50)).map(|k| i(k as i128)).collect()));
        roundtrip(&PyValue::Tuple((0..n).map(|k| i(k as i128 % 100)).collect()));
    }
}

#[test]
fn frames_like_cpython() {
    // pickle.dumps(list(range(40000)), 4): frames at 2 (65537 bytes) and 65548 (54290), 119847 total
    let b = roundtrip(&PyValue::List((0..40000).map(i).collect()));
    assert_eq!(frames(&b), [(2, 65537), (65548, 54290)]);
    assert_eq!(b.len(), 119847);
    // [b'x'*70000, 'y'*70000, 1]: large payloads outside frames; a 3-byte frame gets no header
    let v = PyValue::List(vec![PyValue::Bytes(vec![b'x'; 70000]), s(&"y".repeat(70000)), i(1)]);
    let b = roundtrip(&v);
    assert_eq!(b.len(), 140030);
    assert_eq!(&b[..5], &[0x80, 4, b']', 0x94, b'(']);
    assert_eq!(b[140016], 0x95);
    assert_eq!(u64::from_le_bytes(b[140017..140025].try_into().unwrap()), 5);
}

#[test]
fn memo_shares_containers_and_strings() {
    let mut p = Pickler::new();
    p.list(0..3, |p, k| {
        if k == 0 {
            let m = p.list(["a", "b"], |p, x| p.str(x)).unwrap();
            assert_eq!(m, 1);
        } else {
            p.get(1);
        }
    });
    let b = p.finish();
    let d = pickle::decode(&b).unwrap();
    let items = d.items(d.root()).unwrap();
    assert_eq!(items.len(), 3);
    assert_eq!(items[0], items[1]); // the same list object (same arena id)
    assert_eq!(items[1], items[2]);
    assert_eq!(canon(&d, d.root(), 0), "[[s61,s62],[s61,s62],[s61,s62]]");

    // a list that contains itself
    let mut p = Pickler::new();
    let id = p.memo_len();
    p.list([0, 1], |p, k| if k == 0 { p.int(5) } else { p.get(id) });
    let b = p.finish();
    let d = pickle::decode(&b).unwrap();
    let items = d.items(d.root()).unwrap();
    assert_eq!(items[1], d.root());
}

/// CPython's protocol-4 fixtures (gen_fixtures.py) re-encode to the same bytes, except where
/// CPython wrote two equal strings as two objects (this writer shares equal strings).
#[test]
fn cpython_fixtures_reencode_identically() {
    let mut same = Vec::new();
    for name in ["fixed", "random0", "random1", "random2", "shared", "many", "frames"] {
        let b = fixture(&format!("values/{name}_p4.pickle"));
        let d = pickle::decode(&b).unwrap();
        let out = reencode(&d);
        let d2 = pickle::decode(&out).unwrap();
        assert_eq!(canon(&d2, d2.root(), 0), canon(&d, d.root(), 0), "{name}");
        if out == b {
            same.push(name);
        }
    }
    // These were checked to have no duplicated equal strings.
    for name in ["fixed", "shared", "many", "frames"] {
        assert!(same.contains(&name), "{name}_p4.pickle re-encoded differently (identical: {same:?})");
    }
}

fn arb_value() -> impl Strategy<Value = PyValue> {
    let leaf = prop_oneof![
        Just(PyValue::None),
        any::<bool>().prop_map(PyValue::Bool),
        (-300i128..70000).prop_map(PyValue::Int),
        any::<i64>().prop_map(|x| PyValue::Int(x as i128)),
        any::<i128>().prop_map(PyValue::Int),
        proptest::collection::vec(any::<u8>(), 0..40).prop_map(PyValue::BigInt),
        any::<u64>().prop_map(|b| PyValue::Float(f64::from_bits(b))),
        "[a-cé日\n\"'\\\\]{0,12}".prop_map(PyValue::Str),
        proptest::collection::vec(any::<u8>(), 0..20).prop_map(PyValue::Bytes),
    ];
    leaf.prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..8).prop_map(PyValue::List),
            proptest::collection::vec(inner.clone(), 0..6).prop_map(PyValue::Tuple),
            proptest::collection::vec((inner.clone(), inner.clone()), 0..6).prop_map(PyValue::Dict),
            proptest::collection::vec(inner.clone(), 0..5).prop_map(PyValue::Set),
            proptest::collection::vec(inner, 0..5).prop_map(PyValue::FrozenSet),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn anything_written_decodes_to_itself(v in arb_value()) {
        let b = dumps(&v);
        let d = pickle::decode(&b).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(canon(&d, d.root(), 0), py_canon(&v));
        // and the decoded value re-encodes to the same bytes
        prop_assert_eq!(reencode(&d), b);
    }
}

// ---------------------------------------------------------------------------------------------
// CPython

pub fn python3() -> Option<&'static str> {
    let ok = Command::new("python3").args(["-c", "import pickle"]).output().is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("note: python3 not found; skipping the CPython check");
    }
    ok.then_some("python3")
}

fn scratch_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("allocsim-trace-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// CPython loads every pickle written here, gets the value we meant (same canonical form), and
/// `pickle.dumps(value, protocol=4)` gives back our exact bytes.
#[test]
fn cpython_loads_and_repickles_identically() {
    let Some(py) = python3() else { return };
    let dir = scratch_dir("writer");
    let mut values: Vec<PyValue> = vec![
        PyValue::List((0..40000).map(i).collect()),
        PyValue::List(vec![PyValue::Bytes(vec![b'x'; 70000]), s(&"y".repeat(70000)), i(1)]),
        PyValue::Dict((0..1000).map(|k| (i(k), s(&format!("v{}", k % 7)))).collect()),
        PyValue::Dict((0..2500).map(|k| (s(&format!("k{k}")), i(k * 1_000_000_007))).collect()),
        PyValue::Set((0..1000).map(i).collect()),
        PyValue::Tuple((0..5).map(|k| PyValue::Tuple((0..k).map(i).collect())).collect()),
        PyValue::BigInt(vec![0x81; 300]),
    ];
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    for _ in 0..200 {
        values.push(arb_value().new_tree(&mut runner).unwrap().current());
    }
    let mut script = String::from(
        "import pickle, struct, sys\n\
         def canon(v):\n\
         \x20   if v is None: return 'N'\n\
         \x20   if v is True: return 'T'\n\
         \x20   if v is False: return 'F'\n\
         \x20   if isinstance(v, int): return 'i%d' % v\n\
         \x20   if isinstance(v, float): return 'f' + struct.pack('>d', v).hex()\n\
         \x20   if isinstance(v, str): return 's' + v.encode('utf-8', 'surrogatepass').hex()\n\
         \x20   if isinstance(v, bytes): return 'b' + v.hex()\n\
         \x20   if isinstance(v, list): return '[' + ','.join(map(canon, v)) + ']'\n\
         \x20   if isinstance(v, tuple): return '(' + ','.join(map(canon, v)) + ')'\n\
         \x20   if isinstance(v, frozenset): return 'F{' + ','.join(sorted(map(canon, v))) + '}'\n\
         \x20   if isinstance(v, set): return 'S{' + ','.join(sorted(map(canon, v))) + '}'\n\
         \x20   if isinstance(v, dict): return '{' + ','.join(canon(k) + ':' + canon(x) for k, x in v.items()) + '}'\n\
         \x20   raise TypeError(type(v))\n\
         bad = 0\n\
         for line in open(sys.argv[1]):\n\
         \x20   path, want, exact = line.rstrip('\\n').split('\\t')\n\
         \x20   b = open(path, 'rb').read()\n\
         \x20   v = pickle.loads(b)\n\
         \x20   if canon(v) != want: print('VALUE', path); bad += 1\n\
         \x20   elif exact == '1' and pickle.dumps(v, protocol=4) != b: print('BYTES', path); bad += 1\n\
         print('bad', bad)\n",
    );
    script.push('\n');
    let mut manifest = String::new();
    let mut expected_dupes = 0;
    for (k, v) in values.iter().enumerate() {
        // Python merges equal dict keys and set items (1 == 1.0 == True too); those values cannot
        // round-trip through Python objects, so only their loading is checked.
        let b = dumps(v);
        let path = dir.join(format!("v{k}.pickle"));
        std::fs::write(&path, &b).unwrap();
        if has_python_duplicates(v) {
            expected_dupes += 1;
            continue;
        }
        // Python iterates sets in hash order, so only set-free values re-pickle byte for byte.
        let exact = !has_sets(v) as u8;
        manifest.push_str(&format!("{}\t{}\t{exact}\n", path.display(), py_canon(v)));
    }
    let mf = dir.join("manifest.txt");
    std::fs::write(&mf, manifest).unwrap();
    let out = Command::new(py).args(["-c", &script]).arg(&mf).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.trim_end().ends_with("bad 0"), "{stdout}");
    eprintln!("{} values checked by CPython ({expected_dupes} skipped: duplicate keys)", values.len() - expected_dupes);
    let _ = std::fs::remove_dir_all(&dir);
}

fn has_sets(v: &PyValue) -> bool {
    match v {
        PyValue::Set(x) | PyValue::FrozenSet(x) => x.len() > 1 || x.iter().any(has_sets),
        PyValue::List(x) | PyValue::Tuple(x) => x.iter().any(has_sets),
        PyValue::Dict(p) => p.iter().any(|(k, x)| has_sets(k) || has_sets(x)),
        _ => false,
    }
}

/// Whether Python would merge dict keys / set items of `v` (or NaN/-0.0 keys make `==` unreliable).
fn has_python_duplicates(v: &PyValue) -> bool {
    fn key(v: &PyValue) -> Option<String> {
        Some(match v {
            PyValue::None => "N".into(),
            PyValue::Bool(b) => format!("n{}", *b as i32),
            PyValue::Int(i) => format!("n{i}"),
            PyValue::BigInt(b) if b.is_empty() => "n0".into(),
            PyValue::BigInt(b) => format!("n{}", le_twos_to_decimal(b)),
            PyValue::Float(f) if f.is_nan() => return None,
            PyValue::Float(f) if f.fract() == 0.0 && f.abs() < 1e30 => format!("n{}", *f as i128),
            PyValue::Float(f) => format!("f{}", f.to_bits()),
            PyValue::Str(_) | PyValue::Bytes(_) => py_canon(v),
            PyValue::Tuple(x) | PyValue::FrozenSet(x) => {
                let mut s = Vec::new();
                for y in x {
                    s.push(key(y)?);
                }
                if matches!(v, PyValue::FrozenSet(_)) {
                    s.sort();
                }
                format!("({})", s.join(","))
            }
            // unhashable: Python would raise at unpickling time
            PyValue::List(_) | PyValue::Dict(_) | PyValue::Set(_) => return None,
        })
    }
    let unique = |keys: &mut dyn Iterator<Item = &PyValue>| {
        let mut seen = std::collections::HashSet::new();
        for k in keys {
            match key(k) {
                Some(k) => {
                    if !seen.insert(k) {
                        return false;
                    }
                }
                None => return false,
            }
        }
        true
    };
    match v {
        PyValue::Dict(pairs) => !unique(&mut pairs.iter().map(|(k, _)| k)) || pairs.iter().any(|(k, x)| has_python_duplicates(k) || has_python_duplicates(x)),
        PyValue::Set(x) | PyValue::FrozenSet(x) => !unique(&mut x.iter()) || x.iter().any(has_python_duplicates),
        PyValue::List(x) | PyValue::Tuple(x) => x.iter().any(has_python_duplicates),
        // -0.0 and 0.0 canon differently but a set/dict may keep either: covered by `key`
        _ => false,
    }
}
