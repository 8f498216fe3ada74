"""allocsim's Python API on the repository's traces (no torch): the same answers as the command
line, and the outcomes PyTorch recorded."""

import gzip
import json
import os
import threading
import time

import pytest

import allocsim
from conftest import FRAG, cli, meta, snapshot_dict, trace, without_nvml

FRAG_REL = "traces/frag__default__2048M.pickle.gz"


def test_load_path_bytes_and_dict_are_the_same_snapshot():
    a = allocsim.load(FRAG)
    with open(FRAG, "rb") as f:
        gz = f.read()
    b = allocsim.load(gz)
    c = allocsim.load(gzip.decompress(gz))
    d = allocsim.load(snapshot_dict("frag__default__2048M.pickle.gz"))
    assert a == b == c == d
    assert a != allocsim.load(trace("frag__expandable__2048M.pickle.gz"))
    # 300 tensors allocated, 3 OOMs: request numbers 300, 301 and 302 on device 0.
    assert a.requests(0) == 303
    assert a.recorded_ooms(0) == [300, 301, 302]
    assert sum(a.entries) == meta("frag__default__2048M.pickle.gz")["trace_entries"]
    assert a.segments == meta("frag__default__2048M.pickle.gz")["segments_at_end"]
    assert "frag__default__2048M" in repr(a)


def test_a_pickle_written_back_loads_as_the_same_snapshot():
    a = allocsim.load(FRAG)
    assert allocsim.load(a.to_pickle()) == a


def test_explain_prints_what_the_command_line_prints():
    # The "done when": the same explanation as `allocsim explain TRACE --capacity 2GiB`.
    s = allocsim.load(FRAG_REL)
    x = s.explain(capacity="2GiB")
    p = cli("explain", FRAG_REL, "--capacity", "2GiB")
    assert p.returncode == 0, p.stderr
    assert str(x) + "\n" == p.stdout
    p = cli("explain", FRAG_REL, "--capacity", "2GiB", "--json")
    assert x.to_dict() == json.loads(p.stdout)
    assert json.loads(x.to_json()) == x.to_dict()


def test_explanation_states_pytorchs_message():
    s = allocsim.load(FRAG_REL)
    # By default the OOM that ended the run: the last of the three the job recorded.
    x = s.explain()
    log = meta("frag__default__2048M.pickle.gz")["log"]
    assert x.request == 302
    assert x.message == without_nvml(log[2]["exception"])
    assert x.message in str(x)
    assert x["recorded_oom"] is True
    # It opens the text: the request, which OOM, the cause, the fix, PyTorch's message.
    assert str(x).split("\n")[: len(x.verdict)] == x.verdict
    assert x.verdict[0].startswith("Out of memory at request 302: 1024.00 MiB")
    assert x.fix["kind"] == "memory"
    # The first OOM, and any by request number, each with its own size in PyTorch's words.
    assert s.explain(at="first").message == without_nvml(log[0]["exception"])
    y = s.explain(at=301)
    assert y.message == without_nvml(log[1]["exception"])


def test_explain_without_an_oom():
    s = allocsim.load(FRAG_REL)
    x = s.explain(at="oom", capacity="8GiB")
    assert x.to_dict() == {"explanation": None, "reason": "no OOM", "not_reproduced": False, "settings_changed": []}
    assert "no request runs out of memory" in str(x)
    assert "with 8.00 GiB allowed" in str(x)


def test_replay_reproduces_the_recorded_peaks():
    m = meta("frag__default__2048M.pickle.gz")
    r = allocsim.load(FRAG_REL).replay()
    assert r.peak_reserved == m["max_memory_reserved"]
    assert r.peak_allocated == m["max_memory_allocated"]
    assert [o["request"] for o in r.ooms] == [300, 301, 302]
    assert [o["message"] for o in r.ooms] == [without_nvml(e["exception"]) for e in m["log"]]
    p = cli("replay", FRAG_REL)
    assert str(r) + "\n" == p.stdout
    assert r.to_dict() == json.loads(cli("replay", FRAG_REL, "--json").stdout)


def test_replay_of_a_path_is_the_command_lines():
    # Streamed (the frag trace), and read compactly and replayed in memory (--placements; and
    # a snapshot whose final segments the trace did not allocate, which starts mid-history).
    for args in [(), ("--placements", "2"), ("--config", "expandable_segments:True", "--capacity", str(2 << 30))]:
        kw = {}
        if args and args[0] == "--placements":
            kw["placements"] = 2
        elif args:
            kw = {"config": "expandable_segments:True", "capacity": 2 << 30}
        r = allocsim.replay(FRAG_REL, **kw)
        assert r.to_dict() == json.loads(cli("replay", FRAG_REL, *args, "--json").stdout)
        assert r.to_dict() == allocsim.load(FRAG_REL).replay(**kw).to_dict()
    for name in EXACT:
        rel = os.path.join("traces", name)
        assert allocsim.replay(rel).to_json() == allocsim.load(rel).replay().to_json(), name
    with pytest.raises(allocsim.TraceError):
        allocsim.replay(os.path.join("traces", "no-such-file.pickle"))


def test_replay_under_another_config_and_capacity():
    s = allocsim.load(FRAG_REL)
    r = s.replay(config="expandable_segments:True", capacity=2 << 30)
    assert r["config"] == "expandable_segments:True"
    assert r["capacity"] == 2 << 30
    p = cli("replay", FRAG_REL, "--config", "expandable_segments:True", "--capacity", str(2 << 30), "--json")
    assert r.to_dict() == json.loads(p.stdout)


# The H200 recordings in traces/ and the OOM and training recordings in traces/field (not
# compile_train: CUDA-graph trees free private segments before the snapshot, which the model does
# not reconstruct).
EXACT = sorted(n for n in os.listdir(os.path.dirname(FRAG)) if n.endswith(".pickle.gz")) + sorted(
    "field/" + n
    for n in os.listdir(os.path.join(os.path.dirname(FRAG), "field"))
    if n.endswith(".pickle.gz") and n.split("_")[0] in ("devfull", "fraccap", "llama", "tiny")
)


def test_the_traces_are_there():
    assert len(EXACT) == 25


@pytest.mark.parametrize("name", EXACT)
def test_validate_is_exact_on_the_recordings(name):
    v = allocsim.load(trace(name)).validate()
    assert v.exact, str(v)
    assert v.exit_code == 0
    assert str(v).endswith("exact")


def test_sweep_ranks_like_the_command_line():
    s = allocsim.load(FRAG_REL)
    grid = "expandable_segments=none,True; max_split_size_mb=none,64"
    r = s.sweep(grid={"expandable_segments": [None, True], "max_split_size_mb": [None, 64]}, capacity="2GiB")
    p = cli("sweep", FRAG_REL, "--grid", grid, "--capacity", "2GiB", "--json")
    want = json.loads(p.stdout)
    got = r.to_dict()
    for d in (want, got):
        d.pop("seconds")
    assert got == want
    # Under the recorded 2 GiB cap every config runs out of memory at the 256 MiB request (600 MiB
    # live in 100 segments of 20 MiB, then 256 + 512 + 1024 MiB). The expandable-segments row is
    # the recorded frag__expandable run: the same three OOMs and its max_memory_reserved.
    rows = {row["conf"]: row for row in r.rows}
    exp = meta("frag__expandable__2048M.pickle.gz")
    for o in rows["expandable_segments:True"]["outcomes"]:
        assert (o["first_oom"], o["ooms"], o["peak_reserved"]) == (300, len(exp["log"]), exp["max_memory_reserved"])
    dflt = meta("frag__default__2048M.pickle.gz")
    for o in rows[""]["outcomes"]:
        assert (o["first_oom"], o["ooms"], o["peak_reserved"]) == (300, len(dflt["log"]), dflt["max_memory_reserved"])
    assert r.to_csv() == cli("sweep", FRAG_REL, "--grid", grid, "--capacity", "2GiB", "--csv").stdout
    text = cli("sweep", FRAG_REL, "--grid", grid, "--capacity", "2GiB").stdout
    # The first line ends with the time the sweep took.
    strip = lambda t: [line.rsplit(";", 1)[0] if i == 0 else line for i, line in enumerate(t.split("\n"))]
    assert strip(str(r) + "\n") == strip(text)


def test_fit_answers_for_cards():
    s = allocsim.load(FRAG_REL)
    f = s.fit(cards=["4GiB", 8 << 30])
    p = cli("fit", FRAG_REL, "--cards", f"4GiB,{8 << 30}")
    assert str(f) + "\n" == p.stdout
    d = f.to_dict()
    assert d == json.loads(cli("fit", FRAG_REL, "--cards", f"4GiB,{8 << 30}", "--json").stdout)
    # 300 × 6 MiB requests take 100 segments of 20 MiB (kLargeBuffer); the 12 MiB gaps the frees
    # leave serve none of the 256, 512 and 1024 MiB requests, which get segments of their own.
    assert d["capacity"] == (2000 + 256 + 512 + 1024) << 20
    # The memory outside the allocator is what the OOM entries show: the device's total less the
    # free memory and the 2000 MiB reserved (about 0.5 GiB). A 4 GiB card is short, 8 GiB is not.
    assert 400 << 20 < d["outside_memory"] < 700 << 20
    assert [c["fits"] for c in d["cards"]] == [False, True]
    # Cards as the command line takes them, or sizes of any kind.
    assert s.fit(cards=f"4GiB,{8 << 30}").to_dict() == d
    assert s.fit(cards=("4GiB", float(8 << 30))).to_dict() == d


def test_sizes_are_read_as_the_command_line_reads_them():
    assert allocsim.parse_size("24GiB") == 24 << 30
    assert allocsim.parse_size("2e9") == 2_000_000_000
    # "2GB" is ambiguous (PyTorch prints GiB): refused with both readings.
    with pytest.raises(ValueError, match="2GiB.*2000000000"):
        allocsim.parse_size("2GB")
    s = allocsim.load(FRAG_REL)
    with pytest.raises(ValueError, match="capacity"):
        s.replay(capacity="2GB")
    with pytest.raises(ValueError, match="cards"):
        s.fit(cards="4GiB,lots")


def test_graphs_predicts_other_batch_sizes_from_one_recorded_capture():
    # Captured at 256..1 (H200, torch 2.11); the job recorded memory_reserved() after each capture
    # of a second run at 64, 32, 16, 8.
    a = "traces/field/capture_a__default.pickle.gz"
    recorded = meta("field/capture_a__default.pickle.gz")["extra"]["batches"]
    other = meta("field/capture_c__default.pickle.gz")["extra"]
    g = allocsim.load(a).graphs(recorded, other["batches"])
    args = ("graphs", a, "--captured", ",".join(map(str, recorded)), "--batches", ",".join(map(str, other["batches"])))
    assert str(g) + "\n" == cli(*args).stdout
    assert g.to_dict() == json.loads(cli(*args, "--json").stdout)
    assert [(c["batch"], c["reserved"], c["allocated"]) for c in g.captures] == [
        (c["batch"], c["reserved"], c["allocated"]) for c in other["captures"]
    ]
    with pytest.raises(ValueError, match="9 captures"):
        allocsim.load(a).graphs([256, 128])


def test_phases_finds_every_step_peak_the_job_measured():
    name = "field/llama_train__default.pickle.gz"
    ph = allocsim.load(trace(name)).phases()
    peaks = [it["peak_allocated"] for it in ph.iterations]
    assert peaks == meta(name)["extra"]["step_peaks"]
    assert str(ph) + "\n" == cli("phases", "traces/" + name).stdout
    assert ph.to_dict() == json.loads(cli("phases", "traces/" + name, "--json").stdout)


def test_report_writes_a_page(tmp_path):
    out = tmp_path / "r.html"
    svg = tmp_path / "svg"
    assert allocsim.load(FRAG_REL).report(out, config=["", "expandable_segments:True"], svg_dir=svg) == str(out)
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page
    assert "frag__default__2048M.pickle.gz" in page
    assert sorted(p.name for p in svg.iterdir()) == ["fragmentation.svg", "segments-oom.svg", "segments-peak.svg", "timeline.svg"]


def test_errors_are_exceptions():
    with pytest.raises(allocsim.TraceError, match="nope.pickle"):
        allocsim.load("nope.pickle")
    with pytest.raises(allocsim.TraceError, match="snapshot"):
        allocsim.load(b"\x80\x04not a pickle at all")
    with pytest.raises(allocsim.TraceError):
        allocsim.load({"segments": "no"})
    with pytest.raises(TypeError):
        allocsim.load(42)
    s = allocsim.load(FRAG_REL)
    with pytest.raises(allocsim.ConfigError) as e:
        s.explain(config="foo:1")
    # PyTorch's own text, as its parser raises it.
    assert str(e.value) == "Unrecognized key 'foo' in CUDA allocator config."
    assert isinstance(e.value, allocsim.Error)
    with pytest.raises(allocsim.ConfigError):
        s.replay(config="expandable_segments:maybe")
    with pytest.raises(ValueError, match="parsecs"):
        s.replay(capacity="12 parsecs")
    with pytest.raises(ValueError, match="the trace has 303 requests"):
        s.explain(at=10**6)
    with pytest.raises(ValueError):
        s.sweep(grid="expandable_segments")
    assert issubclass(allocsim.TraceError, allocsim.Error) and issubclass(allocsim.ConfigError, allocsim.Error)


def test_the_command_line_ships_in_the_package():
    p = cli("--help")
    assert p.returncode == 0 and "Usage: allocsim <COMMAND>" in p.stdout
    p = cli("validate", FRAG_REL)
    assert p.returncode == 0 and p.stdout.rstrip().endswith("exact")
    p = cli("explain", "nope.pickle")
    assert p.returncode == 2 and p.stderr.startswith("allocsim: error: nope.pickle") and p.stdout == ""
    p = cli("explain", FRAG_REL, "--config", "foo:1")
    assert p.returncode == 2
    assert p.stderr == "allocsim: error: --config \"foo:1\": Unrecognized key 'foo' in CUDA allocator config.\n"
    p = cli("frobnicate")
    assert p.returncode == 2 and "unrecognized subcommand" in p.stderr


def test_the_allocsim_command_is_installed():
    import shutil
    import subprocess
    import sys

    exe = shutil.which("allocsim", path=os.path.dirname(sys.executable))
    assert exe, "the package's console script `allocsim` is installed beside the interpreter"
    p = subprocess.run([exe, "--version"], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.startswith("allocsim ")


def test_the_gil_is_released_while_replaying():
    # Another Python thread keeps running while a sweep replays (it could not with the GIL held).
    s = allocsim.load(trace("field/llama_train__default.pickle.gz"))
    started, done = threading.Event(), threading.Event()
    out = []

    def work():
        started.set()
        out.append(s.sweep(placements=2))
        done.set()

    t = threading.Thread(target=work)
    t.start()
    started.wait()
    ticks = 0
    t0 = time.monotonic()
    while not done.is_set():
        ticks += 1
        time.sleep(0.001)
    elapsed = time.monotonic() - t0
    t.join()
    assert out and out[0].rows
    # The sweep takes a good part of a second; this thread woke about every millisecond of it.
    assert elapsed > 0.05, "the sweep was too quick to tell"
    assert ticks >= 10


def test_scale_predicts_a_step_at_twice_the_lengths_learnt_from():
    # HF Llama on an H200: learnt from the steps at 128-384 only, the first step at 768 (after the
    # step before it) peaks where the job read max_memory_allocated() after it.
    name = "field/llama_train__default.pickle.gz"
    m = meta(name)["extra"]
    seq = m["seq_lens"]
    i = seq.index(768)
    values = [v if v <= 384 else None for v in seq]
    path = "traces/" + name
    assert os.path.exists(trace(name))
    s = allocsim.load(path)
    r = s.scale("seq", [768], values=values, after=i - 1)
    p = r.predictions[0]
    assert p["peak_allocated"] == [m["step_peaks"][i]] * 2
    assert p["extrapolated"] is True
    args = ("scale", path, "--param", "seq", "--values", ",".join("-" if v is None else str(v) for v in values), "--predict", "768", "--after", str(i - 1))
    assert str(r) + "\n" == cli(*args).stdout
    assert r.to_dict() == json.loads(cli(*args, "--json").stdout)
    # allocsim.scale on paths, and on two traces of one job with a list of values each.
    assert allocsim.scale(path, "seq", [768], values=values, after=i - 1).to_dict() == r.to_dict()
    two = allocsim.scale([path, s], "seq", [768], values=[values, values], after=i - 1)
    assert two.predictions[0]["peak_allocated"] == [m["step_peaks"][i]] * 2
    # Every value given, the 512 and 768 steps held out: the same answer.
    held = s.scale("seq", [768], values=seq, hold_out=[512, 768], after=i - 1)
    assert held.predictions == r.predictions
    with pytest.raises(ValueError, match="no record_function regions named seq=VALUE"):
        s.scale("seq", [768])
    with pytest.raises(ValueError, match="not a shape value"):
        s.scale("seq", [768], values=[0, 512])


def test_scale_finds_the_largest_length_under_the_cap():
    # llama_oom ran 512 under its 6 GiB cap and ran out of memory at 4096 (step 9).
    name = "field/llama_oom__default.pickle.gz"
    m = meta(name)
    s_oom = m["log"][0]["step"]
    values = m["extra"]["seq_lens"][:s_oom]
    r = allocsim.load(trace(name)).scale("seq", values=values, after=s_oom - 1, largest_under=True)
    assert r.largest[0]["capacity"] == m["cap_bytes"]
    assert 512 <= r.largest_value < 4096
    r2 = allocsim.load(trace(name)).scale("seq", values=values, after=s_oom - 1, largest_under="6GiB")
    assert r2.largest_value == r.largest_value


def test_compare_two_recorded_runs_and_two_configs_like_the_command_line():
    a_rel, b_rel = FRAG_REL, "traces/frag__expandable__2048M.pickle.gz"
    a, b = allocsim.load(a_rel), allocsim.load(b_rel)
    c = a.compare(b)
    assert c.to_dict() == json.loads(cli("compare", a_rel, b_rel, "--json").stdout)
    assert str(c) + "\n" == cli("compare", a_rel, b_rel).stdout
    # Each side as recorded: the peaks PyTorch's memory_stats() gave each run.
    recorded = [meta(os.path.basename(r))["memory_stats"]["reserved_bytes.all.peak"] for r in (a_rel, b_rel)]
    assert c.peak_reserved == recorded
    # One trace under two settings: its own (A) and expandable segments (B).
    d = a.compare(config_b="expandable_segments:True", capacity="2000MiB")
    args = ("compare", a_rel, "--config-b", "expandable_segments:True", "--capacity", "2000MiB", "--json")
    assert d.to_dict() == json.loads(cli(*args).stdout)
    assert d.peak_reserved[0] == recorded[0]
    with pytest.raises(allocsim.ConfigError):
        a.compare(config="max_split_size_mb:1")
    with pytest.raises(TypeError):
        a.compare(a_rel)
    with pytest.raises(ValueError):
        a.compare(b, config="expandable_segments:True")
